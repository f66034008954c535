//! `baton bench transfer`: one request's KV moved between two processes, per variant, next to
//! the machine's memcpy and loopback TCP limits measured in the same run, with the speed-up over
//! two naive message-passing transfers: per-slab on a layer-major cache (KVDirect's baseline)
//! and per-block (a stronger one); see `baton_transfer::bench`.

use std::sync::Arc;

use baton_transfer::bench::{BenchDevice, TransferBenchConfig, format_table, run};

/// The benchmark's device with this ordinal: a CUDA GPU, in a build with the `cuda` feature.
pub(crate) fn bench_device(ordinal: usize) -> baton_transfer::Result<Arc<dyn BenchDevice>> {
    #[cfg(feature = "cuda")]
    {
        let device = baton_model::cuda::CudaBenchDevice::new(ordinal)
            .map_err(|e| baton_transfer::TransferError::Device(e.to_string()))?;
        Ok(Arc::new(device))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        Err(baton_transfer::TransferError::Unavailable(
            "this baton was built without CUDA support: rebuild with `cargo build --release --features cuda`",
        ))
    }
}

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
    /// legacy CUDA IPC with `BATON_CUDA_VMM=0`), coalesced and per slab, against the GPU's own
    /// copy bandwidth: `cuda` or `cuda:N` (a build with the `cuda` feature).
    #[arg(long)]
    device: Option<String>,
    /// With --device: only the device rows (the host variants of a GiB take most of a run).
    #[arg(long, requires = "device")]
    device_only: bool,
}

pub(crate) fn transfer(a: TransferArgs) -> anyhow::Result<()> {
    let device = match a.device.as_deref() {
        None | Some("cpu") => None,
        Some(d) => match d.parse::<baton_model::ComputeDevice>().map_err(anyhow::Error::msg)? {
            baton_model::ComputeDevice::Cuda(n) => Some(n),
            baton_model::ComputeDevice::Cpu => None,
        },
    };
    if a.device_only && device.is_none() {
        anyhow::bail!("--device-only needs a device: --device cuda[:N]");
    }
    let config = TransferBenchConfig {
        tokens: a.tokens,
        reps: a.reps,
        device,
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
