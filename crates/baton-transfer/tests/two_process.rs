//! End-to-end transfers between two processes: this test binary re-runs itself as the prefill
//! side (`prefill_child`, selected by an environment variable), which keeps its KV in a real
//! `MemPool` and serves it with a `KvServer`; the test process is the decode side, with its own
//! pool in another layout. Every test checks the destination bytes element by element through
//! the decode pool's arena, and that blocks come back to their owners.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_kv::{BlockId, InstanceId, KvGeometry, KvLayout, KvPart, MemPool, PoolConfig};
use baton_transfer::{
    Access, BlockOwner, ClientConfig, Compat, ErrorCode, KvClient, KvServer, NaiveUnit, PeerId, Region, Release,
    ServerConfig, StandInArena, TransferError, TransferId, TransportChoice, TransportKind,
};

const CHILD_ENV: &str = "BATON_TRANSFER_TEST_PREFILL";
const SECRET: &[u8] = b"test cluster secret";
const POOL_BLOCKS: usize = 40;

fn geometry() -> KvGeometry {
    KvGeometry::new(3, 2, 8, 4)
}

fn compat() -> Compat {
    Compat::new("tiny-test-model", geometry())
}

/// The value every element of a request's KV holds: a function of the request, the block's
/// position in the request and the element's logical coordinates (never of block ids, so the
/// two sides can number blocks differently).
fn value(req: u64, pos: usize, layer: usize, part: KvPart, t: usize, h: usize, x: usize) -> f32 {
    let v = (((req as usize * 200 + pos * 20 + layer * 2 + part as usize) * 8 + t) * 8 + h) * 8 + x;
    v as f32
}

/// Requests the prefill side computes: id and number of blocks.
const REQUESTS: [(u64, usize); 3] = [(1, 5), (2, 3), (3, 4)];

// ---------------------------------------------------------------------------------------------
// The prefill side (child process).

struct PoolOwner(Arc<Mutex<MemPool>>);

impl BlockOwner for PoolOwner {
    fn release(&self, release: Release) {
        let mut pool = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        pool.free_blocks(&release.blocks).expect("leased blocks are held");
    }
}

#[test]
fn prefill_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else { return };
    let opts: HashMap<&str, &str> = spec.split(';').filter_map(|kv| kv.split_once('=')).collect();
    let layout: KvLayout = opts["layout"].parse().expect("layout");
    let lease_ms: u64 = opts["lease_ms"].parse().expect("lease");
    let mut pool = MemPool::new(PoolConfig::device_only(InstanceId(1), geometry(), layout, POOL_BLOCKS)).expect("pool");
    // Fragment the free list so requests get scattered blocks.
    let spacer = pool.alloc_blocks(2).expect("alloc");
    let mut requests: Vec<(u64, Vec<BlockId>)> = Vec::new();
    for (req, n) in REQUESTS {
        let blocks = pool.alloc_blocks(n).expect("alloc");
        let g = geometry();
        for (pos, &b) in blocks.iter().enumerate() {
            for l in 0..g.layers {
                for part in [KvPart::Key, KvPart::Value] {
                    for t in 0..g.block_size {
                        let row = pool.arena_mut().token_mut(l, part, b, t);
                        for (i, e) in row.iter_mut().enumerate() {
                            *e = value(req, pos, l, part, t, i / g.head_dim, i % g.head_dim);
                        }
                    }
                }
            }
        }
        requests.push((req, blocks));
    }
    pool.free_blocks(&spacer).expect("free");
    let handle = pool.arena().handle().expect("shared arena");
    let region = Region::from_arena(&handle, Access::ReadOnly).expect("map own arena");
    let pool = Arc::new(Mutex::new(pool));
    let mut config = ServerConfig::new(PeerId(1), compat(), SECRET);
    config.lease = Duration::from_millis(lease_ms);
    // Its arena poses as a device arena too: a decode side with one of its own reaches it
    // device to device (host memory standing in), one without by shared memory or TCP.
    let device = Region::from_arena(&handle, Access::ReadWrite).expect("map own arena");
    config.device = Some(Arc::new(StandInArena::new(Arc::new(device), 0).expect("stand-in")));
    let server = KvServer::start(config, region, PoolOwner(Arc::clone(&pool))).expect("server");
    for (req, blocks) in &requests {
        if opts.get("mode") != Some(&"push") {
            server.offer(TransferId(*req), blocks.clone()).expect("offer");
        }
    }
    let listing: Vec<String> = requests
        .iter()
        .map(|(r, b)| format!("{r}:{}", b.iter().map(|x| x.0.to_string()).collect::<Vec<_>>().join(",")))
        .collect();
    println!("@@READY {} {}", server.addr(), listing.join(" "));
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["free"] => {
                // Leases first: counting them also ends the due ones.
                let leases = server.live_leases();
                let free = pool.lock().expect("pool").num_free();
                println!("@@FREE {free} {leases}");
            }
            ["push", id, split] => {
                let id: u64 = id.parse().expect("id");
                let split: usize = split.parse().expect("split");
                let blocks = &requests.iter().find(|(r, _)| *r == id).expect("request").1;
                let wait = Duration::from_secs(5);
                let r = server
                    .push(TransferId(id), blocks, 0..split, wait)
                    .and_then(|a| server.push(TransferId(id), blocks, split..geometry().layers, wait).map(|b| (a, b)));
                match r {
                    Ok((a, b)) => println!("@@PUSHED {} {}", a.calls, b.calls),
                    Err(e) => println!("@@ERR {e}"),
                }
            }
            ["layers", id] => {
                // As a chunked prefill streams its KV: the first half of the blocks layer by
                // layer, then the rest (the first block again, as after a preemption), then
                // the blocks go under a lease and the last PUSHED carries a trailer.
                let id: u64 = id.parse().expect("id");
                let blocks = &requests.iter().find(|(r, _)| *r == id).expect("request").1;
                let wait = Duration::from_secs(5);
                let half = blocks.len() / 2;
                let mut pieces = 0;
                let r = (|| {
                    for (first, piece) in [(0, &blocks[..half]), (0, &blocks[..1]), (half, &blocks[half..])] {
                        for l in 0..geometry().layers {
                            server.push_blocks(TransferId(id), piece, first, l..l + 1, wait)?;
                            pieces += 1;
                        }
                    }
                    server.offer(TransferId(id), blocks.clone())?;
                    server.finish_layers(TransferId(id), &[42, 7], wait)
                })();
                match r {
                    Ok(_) => println!("@@LAYERS {pieces}"),
                    Err(e) => println!("@@ERR {e}"),
                }
            }
            _ => break,
        }
        std::io::stdout().flush().expect("stdout");
    }
}

// ---------------------------------------------------------------------------------------------
// The decode side (this process).

struct Prefill {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    addr: SocketAddr,
    requests: HashMap<u64, Vec<BlockId>>,
}

impl Prefill {
    fn spawn(spec: &str) -> Prefill {
        let exe = std::env::current_exe().expect("test binary");
        let mut child = Command::new(exe)
            .args(["prefill_child", "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, spec)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the prefill side");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                // libtest may print its own words before ours on the same line.
                if let Some(at) = line.find("@@")
                    && tx.send(line[at + 2..].to_string()).is_err()
                {
                    break;
                }
            }
        });
        let mut p =
            Prefill { child, stdin, lines, addr: SocketAddr::from(([127, 0, 0, 1], 0)), requests: HashMap::new() };
        let ready = p.next_line();
        let mut words = ready.split_whitespace();
        assert_eq!(words.next(), Some("READY"), "{ready}");
        p.addr = words.next().expect("addr").parse().expect("addr");
        for w in words {
            let (id, blocks) = w.split_once(':').expect("request");
            let blocks = blocks.split(',').map(|b| BlockId(b.parse().expect("block"))).collect();
            p.requests.insert(id.parse().expect("id"), blocks);
        }
        p
    }

    fn next_line(&mut self) -> String {
        match self.lines.recv_timeout(Duration::from_secs(20)) {
            Ok(l) => l,
            Err(RecvTimeoutError::Timeout) => panic!("the prefill side said nothing for 20 s"),
            Err(RecvTimeoutError::Disconnected) => panic!("the prefill side exited"),
        }
    }

    fn cmd(&mut self, c: &str) -> String {
        writeln!(self.stdin, "{c}").expect("write to the prefill side");
        self.stdin.flush().expect("flush");
        self.next_line()
    }

    /// (free blocks, live leases) on the prefill side.
    fn free(&mut self) -> (usize, usize) {
        let l = self.cmd("free");
        let w: Vec<&str> = l.split_whitespace().collect();
        assert_eq!(w[0], "FREE", "{l}");
        (w[1].parse().expect("n"), w[2].parse().expect("n"))
    }

    fn blocks(&self, id: u64) -> Vec<BlockId> {
        self.requests[&id].clone()
    }
}

impl Drop for Prefill {
    fn drop(&mut self) {
        // Ours to end: the child we spawned, by its handle.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Decode {
    pool: MemPool,
    region: Arc<Region>,
}

impl Decode {
    fn new(layout: KvLayout) -> Decode {
        let pool = MemPool::new(PoolConfig::device_only(InstanceId(2), geometry(), layout, POOL_BLOCKS)).expect("pool");
        let handle = pool.arena().handle().expect("shared arena");
        let region = Arc::new(Region::from_arena(&handle, Access::ReadWrite).expect("map own arena"));
        Decode { pool, region }
    }

    fn client(&self, addr: SocketAddr, transport: TransportKind) -> KvClient {
        self.connect(addr, transport.into(), transport == TransportKind::Device).expect("connect")
    }

    /// A client choosing `transport`, with this side's arena posing as a device arena when
    /// `device`.
    fn connect(&self, addr: SocketAddr, transport: TransportChoice, device: bool) -> Result<KvClient, TransferError> {
        let mut config = ClientConfig::new(PeerId(2), compat(), SECRET);
        config.transport = transport;
        config.io_timeout = Duration::from_secs(5);
        if device {
            let arena = StandInArena::new(Arc::clone(&self.region), 0).expect("stand-in");
            config.device = Some(Arc::new(arena));
        }
        KvClient::connect(addr, config, Arc::clone(&self.region))
    }

    /// Allocates `n` blocks, deliberately not in one run.
    fn alloc(&mut self, n: usize) -> Vec<BlockId> {
        let mut blocks = self.pool.alloc_blocks(n + 1).expect("alloc");
        let skipped = blocks.remove(1);
        self.pool.free_blocks(&[skipped]).expect("free");
        blocks
    }
}

fn spec(layout: &str, mode: &str, lease_ms: u64) -> String {
    format!("layout={layout};mode={mode};lease_ms={lease_ms}")
}

fn pull_case(src_layout: &str, dst_layout: KvLayout, transport: TransportKind) {
    let mut prefill = Prefill::spawn(&spec(src_layout, "pull", 10_000));
    let (free_before, leases) = prefill.free();
    assert_eq!(leases, 3);
    let mut decode = Decode::new(dst_layout);
    let mut client = decode.client(prefill.addr, transport);
    assert_eq!(client.transport(), transport);
    let mut got = Vec::new();
    for (req, n) in REQUESTS {
        let local = decode.alloc(n);
        let stats = client.pull(TransferId(req), &prefill.blocks(req), &local).expect("pull");
        assert_eq!(stats.bytes as usize, n * geometry().block_elems() * 4);
        got.push((req, local));
    }
    for (req, local) in &got {
        let others: Vec<BlockId> = got.iter().filter(|(r, _)| r != req).flat_map(|(_, b)| b.clone()).collect();
        check_subset(&decode, *req, local, &others);
    }
    let (free_after, leases) = prefill.free();
    assert_eq!(leases, 0, "every COMPLETE released its lease");
    assert_eq!(free_after, free_before + REQUESTS.iter().map(|r| r.1).sum::<usize>(), "blocks back in the pool");
    for (_, local) in got {
        decode.pool.free_blocks(&local).expect("free");
    }
    decode.pool.check_invariants().expect("decode pool accounting");
}

/// Like `Decode::check`, ignoring blocks of other requests.
fn check_subset(decode: &Decode, req: u64, blocks: &[BlockId], others: &[BlockId]) {
    let g = geometry();
    let arena = decode.pool.arena();
    for (pos, &b) in blocks.iter().enumerate() {
        for l in 0..g.layers {
            for part in [KvPart::Key, KvPart::Value] {
                for (i, &got) in arena.block(l, part, b).iter().enumerate() {
                    let (t, h, x) = (i / g.token_elems(), i / g.head_dim % g.kv_heads, i % g.head_dim);
                    assert_eq!(got, value(req, pos, l, part, t, h, x), "req {req} block {pos} l{l} {part:?}");
                }
            }
        }
    }
    for other in (0..POOL_BLOCKS as u32).map(BlockId).filter(|b| !blocks.contains(b) && !others.contains(b)) {
        for l in 0..g.layers {
            for part in [KvPart::Key, KvPart::Value] {
                assert!(arena.block(l, part, other).iter().all(|&v| v == 0.0), "{other} was touched");
            }
        }
    }
}

#[test]
fn pull_tcp_layer_major_to_block_major() {
    pull_case("layer-major", KvLayout::BlockMajor, TransportKind::Tcp);
}

#[test]
fn pull_shm_block_major_to_layer_major() {
    pull_case("block-major", KvLayout::LayerMajor, TransportKind::Shm);
}

#[test]
fn pull_shm_layer_major_to_block_major() {
    pull_case("layer-major", KvLayout::BlockMajor, TransportKind::Shm);
}

#[test]
fn pull_device_block_major_to_layer_major() {
    pull_case("block-major", KvLayout::LayerMajor, TransportKind::Device);
}

#[test]
fn auto_takes_the_device_path_when_both_arenas_are_on_devices_and_a_forced_one_says_why_not() {
    let prefill = Prefill::spawn(&spec("block-major", "pull", 10_000));
    let decode = Decode::new(KvLayout::BlockMajor);
    let client = decode.connect(prefill.addr, TransportChoice::Auto, true).expect("connect");
    assert_eq!(client.transport(), TransportKind::Device);
    // This side's KV in host memory: the pair shares a host, so shared memory.
    let client = decode.connect(prefill.addr, TransportChoice::Auto, false).expect("connect");
    assert_eq!(client.transport(), TransportKind::Shm);
    match decode.connect(prefill.addr, TransportChoice::Device, false) {
        Err(TransferError::Unreachable(why)) => assert!(why.contains("no device handle"), "{why}"),
        other => panic!("expected the device path refused, got {other:?}"),
    }
}

#[test]
fn pull_tcp_block_major_to_block_major() {
    pull_case("block-major", KvLayout::BlockMajor, TransportKind::Tcp);
}

/// The naive message-passing baselines move the same bytes, one round trip per block or per
/// (block, layer, K/V) slab, between any layouts.
fn naive_case(src_layout: &str, dst_layout: KvLayout) {
    let mut prefill = Prefill::spawn(&spec(src_layout, "pull", 10_000));
    let (free_before, _) = prefill.free();
    let mut decode = Decode::new(dst_layout);
    let mut client = decode.client(prefill.addr, TransportKind::Tcp);
    let g = geometry();
    let units = [(1, NaiveUnit::Slab), (2, NaiveUnit::Block), (3, NaiveUnit::Slab)];
    let mut got = Vec::new();
    for ((req, n), (want_req, unit)) in REQUESTS.into_iter().zip(units) {
        assert_eq!(req, want_req);
        let local = decode.alloc(n);
        let stats = client.pull_naive_by(TransferId(req), &prefill.blocks(req), &local, unit).expect("naive pull");
        assert_eq!(stats.bytes as usize, n * g.block_elems() * 4);
        let per_block = if unit == NaiveUnit::Slab { 2 * g.layers } else { 1 };
        assert_eq!(stats.calls, n * per_block, "{unit:?}");
        got.push((req, local));
    }
    for (req, local) in &got {
        let others: Vec<BlockId> = got.iter().filter(|(r, _)| r != req).flat_map(|(_, b)| b.clone()).collect();
        check_subset(&decode, *req, local, &others);
    }
    let (free_after, leases) = prefill.free();
    assert_eq!(leases, 0, "every COMPLETE released its lease");
    assert_eq!(free_after, free_before + REQUESTS.iter().map(|r| r.1).sum::<usize>());
}

#[test]
fn naive_per_slab_and_per_block_layer_major_to_block_major() {
    naive_case("layer-major", KvLayout::BlockMajor);
}

#[test]
fn naive_per_slab_and_per_block_block_major_to_layer_major() {
    naive_case("block-major", KvLayout::LayerMajor);
}

#[test]
fn block_major_pull_takes_one_call_per_contiguous_run() {
    let prefill = Prefill::spawn(&spec("block-major", "pull", 10_000));
    let mut decode = Decode::new(KvLayout::BlockMajor);
    for transport in [TransportKind::Tcp, TransportKind::Shm] {
        let mut client = decode.client(prefill.addr, transport);
        let (req, n) = if transport == TransportKind::Tcp { REQUESTS[0] } else { REQUESTS[1] };
        let remote = prefill.blocks(req);
        let local = decode.pool.alloc_blocks(n).expect("alloc");
        let stats = client.pull(TransferId(req), &remote, &local).expect("pull");
        let runs = remote
            .windows(2)
            .zip(local.windows(2))
            .filter(|(r, l)| r[1].0 != r[0].0 + 1 || l[1].0 != l[0].0 + 1)
            .count()
            + 1;
        assert_eq!(stats.copies, runs);
        assert!(stats.calls <= runs, "{} calls for {runs} runs", stats.calls);
        check_subset(&decode, req, &local, &[]);
        decode.pool.free_blocks(&local).expect("free");
        decode.pool.arena_mut().as_bytes_mut().fill(0);
    }
    drop(prefill);
}

fn push_case(src_layout: &str, dst_layout: KvLayout, transport: TransportKind) {
    let mut prefill = Prefill::spawn(&spec(src_layout, "push", 10_000));
    let (free_before, _) = prefill.free();
    let mut decode = Decode::new(dst_layout);
    let mut client = decode.client(prefill.addr, transport);
    let (req, n) = REQUESTS[0];
    let local = decode.alloc(n);
    client.begin_push(TransferId(req), req, &local).expect("reserve");
    let pushed = prefill.cmd(&format!("push {req} 1"));
    assert!(pushed.starts_with("PUSHED"), "{pushed}");
    if transport != TransportKind::Tcp {
        // One-sided: a copy per contiguous run (the decode side's blocks are not one run), where
        // TCP sends the layer group in one WRITE. So the push went the way the client offered.
        let calls: usize = pushed.split_whitespace().nth(1).and_then(|c| c.parse().ok()).expect("calls");
        assert!(calls > 1, "{transport:?} push took {calls} call(s): not one-sided? {pushed}");
    }
    let stats = client.finish_push(TransferId(req), Duration::from_secs(5)).expect("push");
    assert_eq!(stats.transport, transport, "the PUSHED frames say how the layers were written");
    assert_eq!(stats.bytes as usize, n * geometry().block_elems() * 4);
    assert_eq!(client.pushed_layers(TransferId(req)), None, "finished pushes are forgotten");
    assert!(stats.calls >= 2, "two layer groups, at least one call each");
    check_subset(&decode, req, &local, &[]);
    let (free_after, leases) = prefill.free();
    assert_eq!((free_after, leases), (free_before + n, 0), "the push's source blocks were released on COMPLETE");
}

/// A layer-wise push: pieces of blocks layer by layer, a block pushed twice, then the last
/// PUSHED with its trailer; the KV arrives whole and COMPLETE ends the lease taken at the end.
fn layerwise_case(src_layout: &str, dst_layout: KvLayout, transport: TransportKind) {
    let mut prefill = Prefill::spawn(&spec(src_layout, "push", 10_000));
    let (free_before, _) = prefill.free();
    let mut decode = Decode::new(dst_layout);
    let mut client = decode.client(prefill.addr, transport);
    let (req, n) = REQUESTS[0];
    let local = decode.alloc(n);
    let id = TransferId(req);
    client.begin_push(id, req, &local).expect("reserve");
    let pushed = prefill.cmd(&format!("layers {req}"));
    assert_eq!(pushed, format!("LAYERS {}", 3 * geometry().layers), "{pushed}");
    let done = client.poll_pushes(Duration::from_secs(5)).expect("poll");
    assert_eq!(done, vec![id], "the last PUSHED ends the push");
    assert_eq!(client.push_progress(id), Some(3 * geometry().layers as u64 + 1), "one PUSHED a piece, one last");
    assert_eq!(client.push_trailer(id), &[42, 7]);
    let stats = client.finish_push(id, Duration::from_secs(5)).expect("complete");
    assert_eq!(stats.transport, transport, "the PUSHED frames say how the layers were written");
    assert_eq!(client.push_trailer(id), &[] as &[u32], "finished pushes are forgotten");
    check_subset(&decode, req, &local, &[]);
    let (free_after, leases) = prefill.free();
    assert_eq!((free_after, leases), (free_before + n, 0), "COMPLETE released the lease taken at the end");
}

#[test]
fn layerwise_push_tcp_layer_major_to_block_major() {
    layerwise_case("layer-major", KvLayout::BlockMajor, TransportKind::Tcp);
}

#[test]
fn layerwise_push_shm_block_major_to_layer_major() {
    layerwise_case("block-major", KvLayout::LayerMajor, TransportKind::Shm);
}

#[test]
fn layerwise_push_device_layer_major_to_block_major() {
    layerwise_case("layer-major", KvLayout::BlockMajor, TransportKind::Device);
}

#[test]
fn push_device_layer_by_layer_block_major_to_block_major() {
    push_case("block-major", KvLayout::BlockMajor, TransportKind::Device);
}

#[test]
fn push_tcp_layer_by_layer_layer_major_to_block_major() {
    push_case("layer-major", KvLayout::BlockMajor, TransportKind::Tcp);
}

#[test]
fn push_shm_layer_by_layer_block_major_to_layer_major() {
    push_case("block-major", KvLayout::LayerMajor, TransportKind::Shm);
}

#[test]
fn expired_lease_releases_blocks_and_refuses_reads() {
    let mut prefill = Prefill::spawn(&spec("layer-major", "pull", 300));
    let (free_before, _) = prefill.free();
    let mut decode = Decode::new(KvLayout::BlockMajor);
    let mut open = Vec::new();
    let clients =
        [(TransportKind::Tcp, REQUESTS[0]), (TransportKind::Shm, REQUESTS[1]), (TransportKind::Device, REQUESTS[2])];
    for (transport, (req, n)) in clients {
        let mut client = decode.client(prefill.addr, transport);
        let local = decode.alloc(n);
        client.open(TransferId(req), &prefill.blocks(req), &local).expect("open within the lease");
        open.push((transport, req, client, local));
    }
    std::thread::sleep(Duration::from_millis(500));
    for (transport, req, mut client, local) in open {
        // TCP refuses the read itself; shared-memory and device reads are one-sided, so
        // COMPLETE refuses.
        let r =
            client.read(TransferId(req), &prefill.blocks(req), &local).and_then(|_| client.complete(TransferId(req)));
        match r {
            Err(TransferError::Remote { code: ErrorCode::LeaseExpired, .. }) => {}
            other => panic!("{transport:?}: expected a lease-expired refusal, got {other:?}"),
        }
        decode.pool.free_blocks(&local).expect("the decode side frees its blocks");
    }
    let (free_after, leases) = prefill.free();
    assert_eq!(leases, 0);
    assert_eq!(free_after, free_before + REQUESTS.iter().map(|r| r.1).sum::<usize>(), "every lease ran out");
    decode.pool.check_invariants().expect("decode accounting");
    assert_eq!(decode.pool.num_free(), POOL_BLOCKS);
}

// A pull over shared memory, or over a device link whose exporter lives (here the child
// process), sends TRANSFER, reads and sends COMPLETE before it hears TRANSFER_OK: what it read
// must still be refused when the lease is unknown or has ended, and each refusal must take both
// answers off the connection, so that the next pull on it works.
#[test]
fn a_one_sided_pull_is_refused_without_a_live_lease_and_stays_in_step() {
    let mut prefill = Prefill::spawn(&spec("block-major", "pull", 1000));
    let (free_before, _) = prefill.free();
    let mut decode = Decode::new(KvLayout::BlockMajor);
    let mut clients = Vec::new();
    for (transport, (req, n)) in [(TransportKind::Shm, REQUESTS[0]), (TransportKind::Device, REQUESTS[1])] {
        let mut client = decode.client(prefill.addr, transport);
        let local = decode.alloc(n);
        match client.pull(TransferId(999), &prefill.blocks(req), &local) {
            Err(TransferError::Remote { code: ErrorCode::UnknownTransfer, .. }) => {}
            other => panic!("{transport:?}: expected an unknown-transfer refusal, got {other:?}"),
        }
        client
            .pull(TransferId(req), &prefill.blocks(req), &local)
            .expect("a pull within the lease, after a refused one");
        clients.push((transport, client, req, local));
    }
    let done: Vec<(u64, Vec<BlockId>)> = clients.iter().map(|(_, _, r, l)| (*r, l.clone())).collect();
    for (req, local) in &done {
        let others: Vec<BlockId> = done.iter().filter(|(r, _)| r != req).flat_map(|(_, b)| b.clone()).collect();
        check_subset(&decode, *req, local, &others);
    }
    std::thread::sleep(Duration::from_millis(1300));
    let (req, n) = REQUESTS[2];
    for (transport, client, _, _) in &mut clients {
        let local = decode.alloc(n);
        match client.pull(TransferId(req), &prefill.blocks(req), &local) {
            Err(TransferError::Remote { code: ErrorCode::LeaseExpired, .. }) => {}
            other => panic!("{transport:?}: expected a lease-expired refusal, got {other:?}"),
        }
        decode.pool.free_blocks(&local).expect("free");
    }
    let want = free_before + REQUESTS.iter().map(|r| r.1).sum::<usize>();
    assert_eq!(prefill.free(), (want, 0), "two pulls completed, the third lease ran out");
    for (_, local) in done {
        decode.pool.free_blocks(&local).expect("free");
    }
    decode.pool.check_invariants().expect("decode accounting");
}

#[test]
fn dead_decode_peer_mid_transfer_leaves_no_blocks_held() {
    let mut prefill = Prefill::spawn(&spec("block-major", "pull", 300));
    let (free_before, _) = prefill.free();
    let decode = Decode::new(KvLayout::BlockMajor);
    {
        let mut client = decode.client(prefill.addr, TransportKind::Tcp);
        let (req, n) = REQUESTS[0];
        let local: Vec<BlockId> = (0..n as u32).map(BlockId).collect();
        client.open(TransferId(req), &prefill.blocks(req), &local).expect("open");
        // The decode side vanishes without COMPLETE.
    }
    // The connection's end drops its leases, then gives their blocks back to the pool: a
    // look in between sees no lease and the blocks not yet free, so wait for both.
    let want = free_before + REQUESTS.iter().map(|r| r.1).sum::<usize>();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (free, leases) = prefill.free();
        if leases == 0 && free == want {
            break;
        }
        assert!(Instant::now() < deadline, "leases still held: {leases}, free blocks {free} of {want}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn dead_prefill_peer_mid_transfer_fails_fast() {
    let mut prefill = Prefill::spawn(&spec("layer-major", "pull", 10_000));
    let mut decode = Decode::new(KvLayout::BlockMajor);
    let mut client = decode.client(prefill.addr, TransportKind::Tcp);
    let (req, n) = REQUESTS[0];
    let remote = prefill.blocks(req);
    let local = decode.alloc(n);
    client.open(TransferId(req), &remote, &local).expect("open");
    let _ = prefill.child.kill();
    let _ = prefill.child.wait();
    let start = Instant::now();
    let r = client.read(TransferId(req), &remote, &local).and_then(|_| client.complete(TransferId(req)));
    assert!(r.is_err(), "a dead peer cannot complete a transfer");
    assert!(start.elapsed() < Duration::from_secs(6), "bounded by the I/O timeout");
    decode.pool.free_blocks(&local).expect("free");
    assert_eq!(decode.pool.num_free(), POOL_BLOCKS, "nothing held on the decode side");
}
