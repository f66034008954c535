//! `baton bench transfer`: one request's KV moved between two processes, per variant, next to
//! the machine's memcpy and loopback TCP limits measured in the same run, with the speed-up over
//! two naive message-passing transfers: per-slab on a layer-major cache (KVDirect's baseline)
//! and per-block (a stronger one); see `baton_transfer::bench`.

use std::sync::Arc;

use baton_model::KvExport;
use baton_transfer::bench::{BenchDevice, StandInBenchDevice, TransferBenchConfig, format_table, run};

/// The benchmark's device with this ordinal, made in both processes from the same `options`
/// (`TransferBenchConfig::device_options`): `stand-in` (host memory behind the device interface),
/// else a CUDA GPU in a build with the `cuda` feature, its arenas exported as `vmm` or `ipc`
/// says (`--kv-export`).
pub(crate) fn bench_device(ordinal: usize, options: &str) -> baton_transfer::Result<Arc<dyn BenchDevice>> {
    let export = match options {
        STAND_IN => return Ok(Arc::new(StandInBenchDevice)),
        "ipc" => KvExport::Ipc,
        _ => KvExport::Vmm,
    };
    baton_model::cuda::bench_device(ordinal, export).map_err(|e| baton_transfer::TransferError::Device(e.to_string()))
}

/// The device options that name the stand-in device.
const STAND_IN: &str = "stand-in";

/// Arguments of `baton bench transfer`.
#[derive(Debug, clap::Args)]
pub(crate) struct TransferArgs {
    /// Request sizes in tokens, comma-separated (Llama-3-8B geometry: 8192 tokens = 1 GiB).
    #[arg(long, value_delimiter = ',', default_value = "8192,2048")]
    tokens: Vec<usize>,
    /// Timed repetitions per variant (after one warm-up); the median is reported.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Also move the KV device to device between two processes' arenas on this GPU (CUDA VMM;
    /// legacy CUDA IPC with `--kv-export ipc`), coalesced and per slab, against the GPU's own
    /// copy bandwidth: `cuda` or `cuda:N` (a build with the `cuda` feature).
    #[arg(long)]
    device: Option<String>,
    /// How the device arenas are shared between the two processes: `vmm` (a CUDA
    /// virtual-memory allocation's descriptor) or `ipc` (legacy CUDA IPC).
    #[arg(long, value_enum, default_value = "vmm", requires = "device")]
    kv_export: crate::engine_flags::KvExportArg,
    /// With --device: only the device rows (the host variants of a GiB take most of a run).
    #[arg(long, requires = "device")]
    device_only: bool,
}

pub(crate) fn transfer(a: TransferArgs) -> anyhow::Result<()> {
    let device = match a.device.as_deref() {
        None | Some("cpu") => None,
        Some(d) => Some(d.parse::<baton_model::ComputeDevice>().map_err(anyhow::Error::msg)?),
    };
    let (ordinal, device_options) = match device {
        None | Some(baton_model::ComputeDevice::Cpu) => (None, String::new()),
        Some(baton_model::ComputeDevice::StandIn) => (Some(0), STAND_IN.to_owned()),
        Some(baton_model::ComputeDevice::Cuda(n)) => {
            let export = match KvExport::from(a.kv_export) {
                KvExport::Vmm => "vmm",
                KvExport::Ipc => "ipc",
            };
            (Some(n), export.to_owned())
        }
    };
    if a.device_only && ordinal.is_none() {
        anyhow::bail!("--device-only needs a device: --device cuda[:N] or stand-in");
    }
    let config = TransferBenchConfig {
        tokens: a.tokens,
        reps: a.reps,
        device: ordinal,
        device_options,
        host: !a.device_only,
        ..TransferBenchConfig::default()
    };
    let report = run(&config, &bench_device)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", format_table(&report));
    }
    Ok(())
}
