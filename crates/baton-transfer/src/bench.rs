//! The transfer benchmark: one request's KV moved between two processes, per variant.
//!
//! [`run`] re-executes the current binary as the prefill side (the binary's `main` must call
//! [`serve_if_child`] first), which fills a region of f16 KV in the source layout and serves it
//! with a [`KvServer`]; this process pulls each request into its own region. For every variant —
//! two naive message-passing transfers, coalesced pull over TCP and over shared memory,
//! layer-major and block-major on either side — it reports GB/s, transport calls per request,
//! contiguous runs, the ratio to the limit measured in the same run (`memcpy` bandwidth for
//! shared memory, a plain bulk TCP send of the same bytes over loopback for TCP), and the
//! speed-up over each naive transfer.
//!
//! The two naive transfers are one gathered request/response round trip per message
//! ([`KvClient::pull_naive_by`]):
//!
//! - **per-slab** on a layer-major cache: one message per `(block, layer, K/V)` slab, 32 KiB at
//!   Llama-3-8B's geometry. This is **KVDirect's baseline**: the paper's message-based transfer
//!   (UCX) moves the KV cache as a vLLM-style engine stores it, one 4–32 KB "block" of one layer
//!   per message (§3, Fig. 3–4; §6, Fig. 15), which is where its 1.8%–13.6% link use comes from.
//! - **per-block** on a block-major cache: one message per whole 16-token block (all layers,
//!   2 MiB at that geometry) — a stronger baseline than the paper's, kept for comparison: its
//!   messages are big enough to fill loopback TCP on their own.
//!
//! With a [`BenchDevice`] (a GPU: `baton bench transfer --device cuda`) both processes also put
//! the KV in device arenas, and two more variants move it device to device through the same
//! client and server (CUDA VMM, or legacy IPC): the coalesced pull, and per-slab (one copy a slab, each waited
//! for: KVDirect's baseline on the device path), against the device's own device-to-device copy
//! bandwidth (`cudaMemcpy`) measured in the same run. Last, the prefill process is killed and
//! its arena, opened once more just before, pulled from: a link that holds the exporter's
//! memory (CUDA VMM, the stand-in) must still read every byte it held ([`ExporterGone`]).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_kv::{BlockId, ByteRange, KvDtype, KvGeometry, KvLayout, TensorDescriptor};
use serde::Serialize;

use crate::plan::RangeCopy;
use crate::{
    ClientConfig, Compat, DeviceArena, DeviceHandle, KvClient, KvServer, NaiveUnit, PeerId, Region, Result,
    ServerConfig, TransferError, TransferId, TransportKind,
};

/// A device the benchmark puts arenas on (a GPU backend provides one).
pub trait BenchDevice: Send + Sync {
    /// What it is, for the report.
    fn name(&self) -> String;
    /// A device arena laid out as `descriptor` (its bytes from offset 0), holding `fill`
    /// repeated.
    fn arena(&self, descriptor: &TensorDescriptor, fill: &[u8]) -> Result<Arc<dyn DeviceArena>>;
    /// Its device-to-device copy bandwidth for `len` bytes between two of its allocations, GB/s:
    /// the device path's limit.
    fn memcpy_gb_per_s(&self, len: usize) -> Result<f64>;
}

/// Host memory standing in for a device ([`crate::StandInArena`]): the device variants' protocol
/// and checks run where there is no GPU; its limit is `memcpy`.
#[derive(Debug, Default)]
pub struct StandInBenchDevice;

impl BenchDevice for StandInBenchDevice {
    fn name(&self) -> String {
        "host memory standing in for a device".into()
    }

    fn arena(&self, descriptor: &TensorDescriptor, fill: &[u8]) -> Result<Arc<dyn DeviceArena>> {
        let region = Region::create(descriptor.clone()).map_err(TransferError::io("creating a stand-in arena"))?;
        fill_region(&region, fill)?;
        Ok(Arc::new(crate::StandInArena::new(Arc::new(region), 0)?))
    }

    fn memcpy_gb_per_s(&self, _len: usize) -> Result<f64> {
        Ok(memcpy_gb_per_s())
    }
}

/// Makes the device with an ordinal (in the prefill-side process too).
pub type DeviceFactory<'a> = &'a dyn Fn(usize, &str) -> Result<Arc<dyn BenchDevice>>;

/// `fill` repeated to 16 MiB or more, a whole number of times: a [`BenchDevice::arena`] fills
/// with it in a few large copies (byte `i` of the arena is `fill[i % fill.len()]` still), not
/// one copy per repeat, which for a fill of one byte is a copy per byte of a GiB arena.
pub fn fill_chunk(fill: &[u8]) -> Vec<u8> {
    if fill.is_empty() {
        return Vec::new();
    }
    fill.repeat((16usize << 20).div_ceil(fill.len()))
}

/// Writes `fill` repeated over the whole of `region` (touching every page).
fn fill_region(region: &Region, fill: &[u8]) -> Result<()> {
    let chunk = fill_chunk(fill);
    let mut at = 0;
    while at < region.len() && !chunk.is_empty() {
        let n = chunk.len().min(region.len() - at);
        region.write(at, &chunk[..n])?;
        at += n;
    }
    Ok(())
}

/// The pattern both processes fill KV with: the decode side spot-checks it.
fn pattern() -> Vec<u8> {
    (0..(1 << 20)).map(|i: usize| (i.wrapping_mul(31) >> 3) as u8).collect()
}

/// Environment variable that makes [`serve_if_child`] run the prefill side.
pub const CHILD_ENV: &str = "BATON_TRANSFER_BENCH_PREFILL";
const SECRET: &[u8] = b"baton-transfer-bench";
const MODEL: &str = "llama-3-8b-geometry";

/// What to measure.
#[derive(Debug, Clone, Serialize)]
pub struct TransferBenchConfig {
    /// Request sizes in tokens (one request each).
    pub tokens: Vec<usize>,
    /// Layers (Llama-3-8B: 32).
    pub layers: usize,
    /// KV heads (8).
    pub kv_heads: usize,
    /// Head dim (128).
    pub head_dim: usize,
    /// Tokens per block (16).
    pub block_size: usize,
    /// Timed repetitions per variant (after one warm-up); the median is reported.
    pub reps: usize,
    /// Also move the KV device to device on the device with this ordinal (a [`BenchDevice`]).
    pub device: Option<usize>,
    /// How the device factory makes its arenas, in its own words (the binary's `--kv-export`),
    /// handed to it in both processes; opaque here.
    pub device_options: String,
    /// The host variants (TCP and shared memory) too; without, only the device rows.
    pub host: bool,
}

impl Default for TransferBenchConfig {
    fn default() -> Self {
        Self {
            tokens: vec![8192, 2048],
            layers: 32,
            kv_heads: 8,
            head_dim: 128,
            block_size: 16,
            reps: 3,
            device: None,
            device_options: String::new(),
            host: true,
        }
    }
}

impl TransferBenchConfig {
    fn geometry(&self) -> KvGeometry {
        KvGeometry {
            layers: self.layers,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            block_size: self.block_size,
            dtype: KvDtype::F16,
        }
    }

    /// Blocks of the largest request, plus room so a layer-major request is not the whole arena.
    fn arena_blocks(&self) -> usize {
        let g = self.geometry();
        self.tokens.iter().map(|&t| g.blocks_for(t)).max().unwrap_or(1) + 64
    }
}

/// What a device link still reads once its exporter has died: [`run`] with a device kills the
/// prefill process after the timed pulls, then pulls from the arena it had exported.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ExporterGone {
    /// Whether the link holds the exporter's memory ([`crate::DeviceLink::outlives_exporter`]:
    /// CUDA VMM, the stand-in). A legacy CUDA IPC link is not asked to read.
    pub outlives_exporter: bool,
    /// Bytes pulled after the exporter died, each checked against what the exporter held.
    pub bytes_checked: u64,
}

/// Opens the exporter's arena (`handle`, laid out as `descriptor`) from `arena`, runs `kill`
/// (the exporter dies), then, on a link that holds the exporter's memory, pulls its first `len`
/// bytes into the first `len` of `arena` and checks each against `want` (the exporter's fill,
/// repeated from offset 0). Those bytes of `arena` must not hold that fill already.
fn pull_after_exporter_died(
    arena: &dyn DeviceArena,
    handle: &DeviceHandle,
    descriptor: &TensorDescriptor,
    len: usize,
    want: &[u8],
    kill: impl FnOnce(),
) -> Result<ExporterGone> {
    let link = arena.open(handle, descriptor)?;
    let outlives_exporter = link.outlives_exporter();
    kill();
    if !outlives_exporter {
        return Ok(ExporterGone { outlives_exporter, bytes_checked: 0 });
    }
    let range = ByteRange { offset: 0, len };
    link.pull(&[RangeCopy { src: range, dst: range }])?;
    let mut got = vec![0u8; 1 << 20];
    let mut at = 0;
    while at < len {
        let n = got.len().min(len - at);
        arena.read_back(at, &mut got[..n])?;
        if let Some(i) = (0..n).find(|&i| got[i] != want[(at + i) % want.len()]) {
            return Err(TransferError::Protocol(format!(
                "after the exporter died, byte {} of its arena read {} instead of {}",
                at + i,
                got[i],
                want[(at + i) % want.len()]
            )));
        }
        at += n;
    }
    Ok(ExporterGone { outlives_exporter, bytes_checked: len as u64 })
}

/// One variant at one request size.
#[derive(Debug, Clone, Serialize)]
pub struct VariantReport {
    /// Request size in tokens.
    pub tokens: usize,
    /// Variant name.
    pub variant: String,
    /// Transport.
    pub transport: TransportKind,
    /// Prefill-side layout.
    pub src_layout: String,
    /// Decode-side layout.
    pub dst_layout: String,
    /// Bytes of the request's KV.
    pub bytes: u64,
    /// Median seconds per request.
    pub seconds: f64,
    /// Bytes / seconds, in 10^9 bytes per second.
    pub gb_per_s: f64,
    /// Transport calls per request.
    pub calls: usize,
    /// Contiguous runs (planned copies) of the request.
    pub runs: usize,
    /// The limit this variant is compared with, GB/s.
    pub limit_gb_per_s: f64,
    /// `gb_per_s / limit_gb_per_s`.
    pub ratio_to_limit: f64,
    /// Speed-up over the naive per-block transfer of the same size (a stronger baseline than
    /// KVDirect's; see the module docs).
    pub speedup_vs_naive: f64,
    /// Speed-up over the naive per-slab transfer of the same size: KVDirect's baseline.
    pub speedup_vs_naive_slab: f64,
}

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct TransferBenchReport {
    /// The configuration.
    pub config: TransferBenchConfig,
    /// memcpy bandwidth of this machine, GB/s.
    pub memcpy_gb_per_s: f64,
    /// Plain bulk TCP send over loopback of each request size, GB/s.
    pub tcp_bulk_gb_per_s: Vec<(usize, f64)>,
    /// The device moved to and from, and its device-to-device copy bandwidth, GB/s.
    pub device: Option<(String, f64)>,
    /// What a device pull read after the prefill process was killed.
    pub exporter_gone: Option<ExporterGone>,
    /// Every variant.
    pub variants: Vec<VariantReport>,
}

/// If this process was started by [`run`] as the prefill side, serves until its parent closes
/// stdin and returns `true` (the caller then exits); otherwise returns `false` at once.
pub fn serve_if_child() -> bool {
    serve_if_child_with(&|_, _| Err(TransferError::Unavailable("this binary has no benchmark device")))
}

/// [`serve_if_child`], making a device arena with `device` when the run asks for one.
pub fn serve_if_child_with(device: DeviceFactory<'_>) -> bool {
    let Ok(spec) = std::env::var(CHILD_ENV) else { return false };
    if let Err(e) = child(&spec, device) {
        eprintln!("prefill side failed: {e}");
        std::process::exit(1);
    }
    true
}

fn child(spec: &str, device: DeviceFactory<'_>) -> Result<()> {
    let config: ChildSpec = serde_json::from_str(spec).map_err(|e| TransferError::Protocol(e.to_string()))?;
    let bench = TransferBenchConfig { tokens: config.tokens.clone(), ..TransferBenchConfig::default() };
    let g =
        KvGeometry { layers: config.layers, kv_heads: config.kv_heads, head_dim: config.head_dim, ..bench.geometry() };
    let g = KvGeometry { block_size: config.block_size, ..g };
    let layout: KvLayout = config.layout.parse().map_err(TransferError::Protocol)?;
    let desc = TensorDescriptor::new(&g, layout, config.arena_blocks);
    let region = Region::create(desc).map_err(TransferError::io("creating the source region"))?;
    // Touch and fill every page: a deterministic pattern the decode side can spot-check.
    let chunk = pattern();
    fill_region(&region, &chunk)?;
    let mut sc = ServerConfig::new(PeerId(1), Compat::new(MODEL, g), SECRET);
    sc.lease = Duration::from_secs(600);
    sc.io_timeout = Duration::from_secs(60);
    if let Some(ordinal) = config.device {
        sc.device = Some(device(ordinal, &config.device_options)?.arena(region.descriptor(), &chunk)?);
    }
    let bulk = TcpListener::bind("127.0.0.1:0").map_err(TransferError::io("binding"))?;
    let bulk_addr = bulk.local_addr().map_err(TransferError::io("binding"))?;
    let server = KvServer::start(sc, region, std::sync::mpsc::channel().0)?;
    // The TCP limit: a plain bulk send of the region's first `len` bytes (`len` from the peer).
    let source = crate::Region::open(
        &server.region().shm_handle().ok_or(TransferError::Unavailable("no shm"))?,
        server.region().descriptor().clone(),
        crate::Access::ReadOnly,
    )
    .map_err(TransferError::io("mapping the source"))?;
    std::thread::spawn(move || {
        for stream in bulk.incoming() {
            let Ok(mut s) = stream else { continue };
            let mut len = [0u8; 8];
            if s.read_exact(&mut len).is_err() {
                continue;
            }
            let len = u64::from_le_bytes(len) as usize;
            // A failed send shows up on the receiving side.
            let _ = source.with_bytes(ByteRange { offset: 0, len }, |b| s.write_all(b));
        }
    });
    for (k, &t) in config.tokens.iter().enumerate() {
        let blocks: Vec<BlockId> = (0..g.blocks_for(t) as u32).map(BlockId).collect();
        for rep in 0..64u64 {
            server.offer(TransferId(k as u64 * 1000 + rep), blocks.clone())?;
        }
    }
    println!("@@READY {} {bulk_addr}", server.addr());
    std::io::stdout().flush().map_err(TransferError::io("writing to the parent"))?;
    // Serve until the parent closes our stdin.
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    server.shutdown();
    Ok(())
}

#[derive(Debug, Serialize, serde::Deserialize)]
struct ChildSpec {
    layout: String,
    device: Option<usize>,
    #[serde(default)]
    device_options: String,
    tokens: Vec<usize>,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    arena_blocks: usize,
}

struct Prefill {
    child: std::process::Child,
    addr: SocketAddr,
    bulk: SocketAddr,
}

impl Prefill {
    fn spawn(config: &TransferBenchConfig, layout: &str, device: Option<usize>) -> Result<Prefill> {
        let spec = ChildSpec {
            layout: layout.into(),
            device,
            device_options: config.device_options.clone(),
            tokens: config.tokens.clone(),
            layers: config.layers,
            kv_heads: config.kv_heads,
            head_dim: config.head_dim,
            block_size: config.block_size,
            arena_blocks: config.arena_blocks(),
        };
        let exe = std::env::current_exe().map_err(TransferError::io("finding this binary"))?;
        let spec = serde_json::to_string(&spec).map_err(|e| TransferError::Protocol(e.to_string()))?;
        let mut child = Command::new(exe)
            .env(CHILD_ENV, spec)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(TransferError::io("spawning the prefill side"))?;
        let stdout = child.stdout.take().ok_or(TransferError::PeerClosed("starting the prefill side"))?;
        let mut line = String::new();
        let mut reader = BufReader::new(stdout);
        loop {
            line.clear();
            if reader.read_line(&mut line).map_err(TransferError::io("reading the prefill side"))? == 0 {
                return Err(TransferError::PeerClosed("starting the prefill side"));
            }
            if let Some(at) = line.find("@@READY ") {
                let bad = || TransferError::Protocol(line.clone());
                let mut words = line[at + 8..].split_whitespace();
                let addr = words.next().and_then(|w| w.parse().ok()).ok_or_else(bad)?;
                let bulk = words.next().and_then(|w| w.parse().ok()).ok_or_else(bad)?;
                return Ok(Prefill { child, addr, bulk });
            }
        }
    }
}

impl Prefill {
    /// Kills the prefill process (SIGKILL, as a crash would end it) and reaps it.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Prefill {
    fn drop(&mut self) {
        // Closing stdin ends the child; wait for it (it is ours).
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

/// The median of the shared definition ([`baton_measure::percentile`]: of an even count, the
/// mean of the middle two); NaN of nothing.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { f64::NAN } else { baton_measure::percentile(&v, 50.0) }
}

/// memcpy bandwidth: copies between two 256 MiB buffers, median of 5.
fn memcpy_gb_per_s() -> f64 {
    let n = 256 << 20;
    let src = vec![7u8; n];
    let mut dst = vec![1u8; n];
    dst.copy_from_slice(&src);
    let times: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(&src);
            std::hint::black_box(&mut dst);
            t.elapsed().as_secs_f64()
        })
        .collect();
    n as f64 / median(times) / 1e9
}

/// A plain bulk TCP send over loopback of `len` bytes from the prefill process into `dst`,
/// median of `reps` after a warm-up.
fn tcp_bulk_gb_per_s(bulk: SocketAddr, dst: &Region, len: usize, reps: usize) -> Result<f64> {
    let mut times = Vec::new();
    for _ in 0..reps + 1 {
        let mut s = TcpStream::connect(bulk).map_err(TransferError::io("connecting"))?;
        let t = Instant::now();
        s.write_all(&(len as u64).to_le_bytes()).map_err(TransferError::io("bulk request"))?;
        // SAFETY: `dst` is this benchmark's own region; nothing else touches it meanwhile.
        #[allow(unsafe_code)]
        unsafe { dst.with_bytes_mut(ByteRange { offset: 0, len }, |b| s.read_exact(b)) }?
            .map_err(TransferError::io("bulk receive"))?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.remove(0);
    Ok(len as f64 / median(times) / 1e9)
}

struct Variant {
    name: &'static str,
    transport: TransportKind,
    src: &'static str,
    dst: KvLayout,
    naive: Option<NaiveUnit>,
}

const NAIVE_BLOCK: &str = "naive per-block";
const NAIVE_SLAB: &str = "naive per-slab";

const VARIANTS: [Variant; 8] = [
    Variant {
        name: NAIVE_BLOCK,
        transport: TransportKind::Tcp,
        src: "block-major",
        dst: KvLayout::BlockMajor,
        naive: Some(NaiveUnit::Block),
    },
    Variant {
        name: NAIVE_SLAB,
        transport: TransportKind::Tcp,
        src: "layer-major",
        dst: KvLayout::LayerMajor,
        naive: Some(NaiveUnit::Slab),
    },
    Variant {
        name: "coalesced pull",
        transport: TransportKind::Tcp,
        src: "block-major",
        dst: KvLayout::BlockMajor,
        naive: None,
    },
    Variant {
        name: "coalesced pull",
        transport: TransportKind::Tcp,
        src: "layer-major",
        dst: KvLayout::LayerMajor,
        naive: None,
    },
    Variant {
        name: "coalesced pull",
        transport: TransportKind::Tcp,
        src: "layer-major",
        dst: KvLayout::BlockMajor,
        naive: None,
    },
    Variant {
        name: "coalesced pull",
        transport: TransportKind::Shm,
        src: "block-major",
        dst: KvLayout::BlockMajor,
        naive: None,
    },
    Variant {
        name: "coalesced pull",
        transport: TransportKind::Shm,
        src: "layer-major",
        dst: KvLayout::LayerMajor,
        naive: None,
    },
    Variant {
        name: "coalesced pull",
        transport: TransportKind::Shm,
        src: "layer-major",
        dst: KvLayout::BlockMajor,
        naive: None,
    },
];

/// One request pulled `reps` timed times after a warm-up, under the transfer ids the prefill
/// side offered for request size `k` (`k * 1000 + n`, each used once).
struct Pulls<'a> {
    k: usize,
    remote: &'a [BlockId],
    local: &'a [BlockId],
    naive: Option<NaiveUnit>,
    reps: usize,
}

impl Pulls<'_> {
    /// The median seconds of the timed pulls, and the last one's figures.
    fn time(&self, client: &mut KvClient, next_id: &mut u64) -> Result<(f64, crate::TransferStats)> {
        let mut times = Vec::new();
        let mut last = crate::TransferStats::default();
        for rep in 0..self.reps + 1 {
            let id = TransferId(self.k as u64 * 1000 + *next_id);
            *next_id += 1;
            let stats = match self.naive {
                Some(unit) => client.pull_naive_by(id, self.remote, self.local, unit)?,
                None => client.pull(id, self.remote, self.local)?,
            };
            if rep > 0 {
                times.push(stats.elapsed.as_secs_f64());
            }
            last = stats;
        }
        Ok((median(times), last))
    }
}

impl VariantReport {
    /// A variant's row from its timed pulls (speed-ups filled in once every row is in).
    fn new(
        tokens: usize,
        variant: &str,
        layouts: (&str, &str),
        seconds: f64,
        last: &crate::TransferStats,
        limit: f64,
    ) -> Self {
        let gbps = last.bytes as f64 / seconds / 1e9;
        VariantReport {
            tokens,
            variant: variant.into(),
            transport: last.transport,
            src_layout: layouts.0.into(),
            dst_layout: layouts.1.into(),
            bytes: last.bytes,
            seconds,
            gb_per_s: gbps,
            calls: last.calls,
            runs: last.copies,
            limit_gb_per_s: limit,
            ratio_to_limit: gbps / limit,
            speedup_vs_naive: f64::NAN,
            speedup_vs_naive_slab: f64::NAN,
        }
    }
}

fn layout_name(l: KvLayout) -> &'static str {
    match l {
        KvLayout::LayerMajor => "layer-major",
        KvLayout::BlockMajor => "block-major",
    }
}

/// Runs the benchmark (see the module docs); `device` makes the device of
/// [`TransferBenchConfig::device`].
pub fn run(config: &TransferBenchConfig, device: DeviceFactory<'_>) -> Result<TransferBenchReport> {
    let g = config.geometry();
    let compat = Compat::new(MODEL, g);
    let memcpy = memcpy_gb_per_s();
    let mut variants: Vec<VariantReport> = Vec::new();
    let mut tcp_bulk: Vec<(usize, f64)> = Vec::new();
    let host_layouts: &[&str] = if config.host { &["block-major", "layer-major"] } else { &[] };
    for &src_layout in host_layouts {
        let prefill = Prefill::spawn(config, src_layout, None)?;
        // Transfer ids the child offered: 64 per size, each used once.
        let mut next_id = vec![0u64; config.tokens.len()];
        for dst_layout in [KvLayout::BlockMajor, KvLayout::LayerMajor] {
            let todo: Vec<&Variant> = VARIANTS.iter().filter(|v| v.src == src_layout && v.dst == dst_layout).collect();
            if todo.is_empty() {
                continue;
            }
            let dst = Arc::new(
                Region::create(TensorDescriptor::new(&g, dst_layout, config.arena_blocks()))
                    .map_err(TransferError::io("creating the destination region"))?,
            );
            for (k, &tokens) in config.tokens.iter().enumerate() {
                let n = g.blocks_for(tokens);
                let remote: Vec<BlockId> = (0..n as u32).map(BlockId).collect();
                let local: Vec<BlockId> = (64..64 + n as u32).map(BlockId).collect();
                if src_layout == "block-major" && dst_layout == KvLayout::BlockMajor {
                    let bytes = n * g.block_size * g.bytes_per_token();
                    tcp_bulk.push((tokens, tcp_bulk_gb_per_s(prefill.bulk, &dst, bytes, config.reps)?));
                }
                let bulk = tcp_bulk.iter().find(|(t, _)| *t == tokens).map_or(f64::NAN, |x| x.1);
                for v in &todo {
                    let mut cc = ClientConfig::new(PeerId(2), compat.clone(), SECRET);
                    cc.transport = v.transport.into();
                    cc.io_timeout = Duration::from_secs(60);
                    let mut client = KvClient::connect(prefill.addr, cc, Arc::clone(&dst))?;
                    let pulls = Pulls { k, remote: &remote, local: &local, naive: v.naive, reps: config.reps };
                    let (seconds, last) = pulls.time(&mut client, &mut next_id[k])?;
                    let limit = if v.transport == TransportKind::Shm { memcpy } else { bulk };
                    let layouts = (src_layout, layout_name(dst_layout));
                    variants.push(VariantReport::new(tokens, v.name, layouts, seconds, &last, limit));
                }
            }
        }
        drop(prefill);
    }
    let (device_report, exporter_gone) = match config.device {
        Some(ordinal) => {
            let (name, limit, gone) =
                device_variants(config, device(ordinal, &config.device_options)?.as_ref(), ordinal, &mut variants)?;
            (Some((name, limit)), gone)
        }
        None => (None, None),
    };
    for t in &config.tokens {
        let naive = |name: &str| {
            let host = |v: &&VariantReport| v.tokens == *t && v.variant == name && v.transport != TransportKind::Device;
            variants.iter().find(host).map(|v| v.gb_per_s)
        };
        let (block, slab) = (naive(NAIVE_BLOCK), naive(NAIVE_SLAB));
        // Device rows are compared with the device's per-slab transfer (the same path).
        let device_slab = variants
            .iter()
            .find(|v| v.tokens == *t && v.variant == NAIVE_SLAB && v.transport == TransportKind::Device)
            .map(|v| v.gb_per_s);
        for v in variants.iter_mut().filter(|v| v.tokens == *t) {
            let slab = if v.transport == TransportKind::Device { device_slab } else { slab };
            v.speedup_vs_naive = block.map_or(f64::NAN, |n| v.gb_per_s / n);
            v.speedup_vs_naive_slab = slab.map_or(f64::NAN, |n| v.gb_per_s / n);
        }
    }
    variants.sort_by_key(|v| std::cmp::Reverse(v.tokens));
    Ok(TransferBenchReport {
        config: config.clone(),
        memcpy_gb_per_s: memcpy,
        tcp_bulk_gb_per_s: tcp_bulk,
        device: device_report,
        exporter_gone,
        variants,
    })
}

/// The device variants: both sides' KV in device arenas (block-major), pulled device to device
/// through the client and server, coalesced and per slab, each request spot-checked against the
/// pattern; the limit is the device's own copy bandwidth. Then a pull after the prefill process
/// was killed ([`pull_after_exporter_died`], into blocks the timed pulls left untouched).
/// Returns the device's name and limit, and what that pull read.
fn device_variants(
    config: &TransferBenchConfig,
    device: &dyn BenchDevice,
    ordinal: usize,
    variants: &mut Vec<VariantReport>,
) -> Result<(String, f64, Option<ExporterGone>)> {
    let g = config.geometry();
    let mut prefill = Prefill::spawn(config, "block-major", Some(ordinal))?;
    let desc = TensorDescriptor::new(&g, KvLayout::BlockMajor, config.arena_blocks());
    let host = Arc::new(Region::create(desc).map_err(TransferError::io("creating the destination region"))?);
    let arena = device.arena(host.descriptor(), &[0])?;
    let largest = config.tokens.iter().map(|&t| g.blocks_for(t) * g.block_size * g.bytes_per_token()).max();
    let limit = device.memcpy_gb_per_s(largest.unwrap_or(1 << 20))?;
    let want = pattern();
    let mut next_id = vec![0u64; config.tokens.len()];
    // The prefill side's device handle and layout, as CONNECT gave them.
    let mut theirs: Option<(DeviceHandle, TensorDescriptor)> = None;
    for (k, &tokens) in config.tokens.iter().enumerate() {
        let n = g.blocks_for(tokens);
        let remote: Vec<BlockId> = (0..n as u32).map(BlockId).collect();
        let local: Vec<BlockId> = (64..64 + n as u32).map(BlockId).collect();
        for (name, naive) in [("coalesced pull", None), (NAIVE_SLAB, Some(NaiveUnit::Slab))] {
            let mut cc = ClientConfig::new(PeerId(2), Compat::new(MODEL, g), SECRET);
            cc.transport = crate::TransportChoice::Device;
            cc.device = Some(Arc::clone(&arena));
            cc.io_timeout = Duration::from_secs(60);
            let mut client = KvClient::connect(prefill.addr, cc, Arc::clone(&host))?;
            let remote_info = client.remote();
            theirs = remote_info.reach.device.clone().map(|h| (h, remote_info.descriptor.clone()));
            let pulls = Pulls { k, remote: &remote, local: &local, naive, reps: config.reps };
            let (seconds, last) = pulls.time(&mut client, &mut next_id[k])?;
            // Bytes from the start, the end and 62 points between arrived where they belong.
            let block_bytes = g.block_size * g.bytes_per_token();
            let span = n * block_bytes - 64;
            for src in (0..64).map(|i| (span / 63 * i) & !15).chain([span]) {
                let dst = 64 * block_bytes + src;
                let mut got = [0u8; 64];
                arena.read_back(dst, &mut got)?;
                let expected: Vec<u8> = (src..src + 64).map(|i| want[i % want.len()]).collect();
                if got[..] != expected[..] {
                    return Err(TransferError::Protocol(format!("{name}: the device copy differs at byte {dst}")));
                }
            }
            let layouts = ("block-major", "block-major");
            variants.push(VariantReport::new(tokens, name, layouts, seconds, &last, limit));
        }
    }
    // Blocks 0..64 of this side's arena were never pulled into (the timed pulls used 64..).
    let block_bytes = g.block_size * g.bytes_per_token();
    let len = config.tokens.iter().map(|&t| g.blocks_for(t)).min().unwrap_or(1).min(64) * block_bytes;
    let gone = match theirs {
        Some((handle, descriptor)) => {
            Some(pull_after_exporter_died(arena.as_ref(), &handle, &descriptor, len, &want, || prefill.kill())?)
        }
        None => None,
    };
    drop(prefill);
    Ok((device.name(), limit, gone))
}

/// The human-readable table.
pub fn format_table(report: &TransferBenchReport) -> String {
    let mut out = String::new();
    if report.config.host {
        out.push_str(&format!(
            "memcpy {:.2} GB/s; bulk TCP over loopback: {}\n",
            report.memcpy_gb_per_s,
            report
                .tcp_bulk_gb_per_s
                .iter()
                .map(|(t, g)| format!("{t} tokens {g:.2} GB/s"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    if let Some((name, gbps)) = &report.device {
        out.push_str(&format!("device: {name}, device-to-device copy (cudaMemcpy) {gbps:.1} GB/s\n"));
    }
    match report.exporter_gone {
        Some(ExporterGone { outlives_exporter: true, bytes_checked }) => out.push_str(&format!(
            "after the prefill process was killed: {:.0} MiB pulled from its device arena, every byte as it was \
             (the link holds the exporter's memory)\n",
            bytes_checked as f64 / (1 << 20) as f64
        )),
        Some(ExporterGone { outlives_exporter: false, .. }) => out.push_str(
            "after the prefill process was killed: not read (a legacy CUDA IPC link must not touch a dead \
             exporter's memory)\n",
        ),
        None => {}
    }
    out.push_str(&format!(
        "{:>6} {:<16} {:<6} {:<26} {:>8} {:>9} {:>7} {:>6} {:>6} {:>7} {:>6} {:>8} {:>8}\n",
        "tokens",
        "variant",
        "via",
        "layouts (prefill → decode)",
        "MiB",
        "ms",
        "GB/s",
        "calls",
        "runs",
        "limit",
        "ratio",
        "vs slab",
        "vs block"
    ));
    // A speed-up over a baseline the run did not measure (the host rows of a device-only run).
    let times = |x: f64| if x.is_finite() { format!("{x:.1}x") } else { "-".into() };
    for v in &report.variants {
        let via = v.transport.to_string();
        out.push_str(&format!(
            "{:>6} {:<16} {:<6} {:<26} {:>8.0} {:>9.1} {:>7.2} {:>6} {:>6} {:>7.2} {:>6.2} {:>8} {:>8}\n",
            v.tokens,
            v.variant,
            via,
            format!("{} → {}", v.src_layout, v.dst_layout),
            v.bytes as f64 / (1 << 20) as f64,
            v.seconds * 1e3,
            v.gb_per_s,
            v.calls,
            v.runs,
            v.limit_gb_per_s,
            v.ratio_to_limit,
            times(v.speedup_vs_naive_slab),
            times(v.speedup_vs_naive),
        ));
    }
    out.push_str(
        "vs slab: speed-up over naive per-slab, KVDirect's baseline (one request/response message per \
         (block, layer, K/V) slab of a layer-major cache, as the paper's UCX transfer moves vLLM's KV).\n\
         vs block: speed-up over naive per-block (one message per whole block, all layers: a stronger \
         baseline than the paper's).\n\
         Device rows (via device): limit = the device's own cudaMemcpy; vs slab = over the device path's \
         per-slab transfer (one device-to-device copy a slab, each waited for).\n",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fill_chunk_is_whole_repeats_of_the_fill() {
        assert!(fill_chunk(&[]).is_empty());
        let one = fill_chunk(&[7]);
        assert!(one.len() >= 16 << 20 && one.iter().all(|&b| b == 7));
        let pattern = [1u8, 2, 3];
        let chunk = fill_chunk(&pattern);
        assert_eq!(chunk.len() % pattern.len(), 0);
        assert!(chunk.iter().enumerate().all(|(i, &b)| b == pattern[i % pattern.len()]));
    }

    /// A stand-in link reads its exporter's bytes after the exporter is gone (its arena, share
    /// and memfd dropped: all a dead process lets go of), and the check tells other bytes apart.
    #[test]
    fn a_stand_in_link_reads_its_exporter_after_the_exporter_is_gone() {
        let g = KvGeometry { layers: 2, kv_heads: 2, head_dim: 64, ..TransferBenchConfig::default().geometry() };
        let desc = TensorDescriptor::new(&g, KvLayout::BlockMajor, 8);
        let len = 4 * g.block_size * g.bytes_per_token();
        let fill: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 1) as u8).collect();
        let importer = StandInBenchDevice.arena(&desc, &[0]).expect("importer");
        for (want, ok) in [(fill.clone(), true), (vec![1u8, 2, 3], false)] {
            let exporter = StandInBenchDevice.arena(&desc, &fill).expect("exporter");
            let handle = exporter.handle();
            let mut exporter = Some(exporter);
            let gone =
                pull_after_exporter_died(importer.as_ref(), &handle, &desc, len, &want, || drop(exporter.take()));
            assert!(exporter.is_none(), "the exporter was dropped before the pull");
            match gone {
                Ok(gone) => {
                    assert!(ok, "bytes other than the exporter's passed the check");
                    assert!(gone.outlives_exporter);
                    assert_eq!(gone.bytes_checked, len as u64);
                }
                Err(e) => assert!(!ok, "{e}"),
            }
        }
    }

    // An arena several chunks long, filled with one byte (as the benchmark's destination is)
    // and with a pattern whose length does not divide a chunk's: each byte continues the fill.
    #[test]
    fn a_stand_in_arena_holds_its_fill_repeated() {
        let g = KvGeometry {
            layers: 2,
            kv_heads: 2,
            head_dim: 64,
            block_size: 16,
            ..TransferBenchConfig::default().geometry()
        };
        let desc = TensorDescriptor::new(&g, KvLayout::BlockMajor, (40 << 20) / (g.block_size * g.bytes_per_token()));
        let len = desc.num_bytes();
        for fill in [vec![9u8], (0..1000u32).map(|i| (i * 7) as u8).collect()] {
            let arena = StandInBenchDevice.arena(&desc, &fill).expect("a stand-in arena");
            for at in [0, (16 << 20) - 3, len - 64] {
                let mut got = [0u8; 64];
                arena.read_back(at, &mut got).expect("read back");
                assert!(got.iter().enumerate().all(|(i, &b)| b == fill[(at + i) % fill.len()]), "at {at}");
            }
        }
    }
}
