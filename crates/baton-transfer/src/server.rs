//! The prefill side: a KV server serving a region to decode peers.
//!
//! [`KvServer::start`] binds a listener and runs, on threads of its own, an acceptor (which
//! holds each new connection, threadless, until its member ticket is in, and sorts members from
//! strangers: `admit.rs`), one thread per connection (handshake, then TRANSFER / READ /
//! COMPLETE) and a reaper that ends leases whose deadline passed. The engine loop is not involved in any read: it offers a request's
//! blocks ([`KvServer::offer`]), gets them back through its [`BlockOwner`] when the decode side
//! completes or the lease runs out, and in push mode writes layers with [`KvServer::push`].

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use baton_kv::CopyDirection;
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use baton_kv::{BlockId, ByteRange, Dim};

use crate::admit::{Admission, Tickets, Triage};
use crate::auth::{self, Side};
use crate::compat::Compat;
use crate::conn::Conn;
use crate::device::{DeviceArena, DeviceLink};
use crate::frame::{EndpointInfo, ErrorCode, FLAG_GATHER, Frame, TransferMode, check_peer};
use crate::lease::{LeaseError, LeaseTable, Release};
use crate::location::{HostId, Location, Reach, TransportChoice, choose};
use crate::plan::plan_layers;
use crate::region::{Access, Region};
use crate::transport::{ProcessWatch, TransportKind};
use crate::{PeerId, Result, TransferError, TransferId, TransferStats};

/// Whoever owns the blocks the server leases (the prefill engine's pool): gets them back when a
/// lease ends. Called from the server's threads; keep it short (send to the engine's loop).
pub trait BlockOwner: Send + Sync + 'static {
    /// The lease of `release.id` ended; its blocks are the owner's again.
    fn release(&self, release: Release);
}

/// The engine's way in: releases arrive on a channel its loop drains each step.
impl BlockOwner for Sender<Release> {
    fn release(&self, release: Release) {
        // A closed receiver means the engine is gone, and its pool with it: nothing to free.
        let _ = self.send(release);
    }
}

/// Configuration of a [`KvServer`].
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// This worker.
    pub peer: PeerId,
    /// Model, geometry and layout version served.
    pub compat: Compat,
    /// The cluster secret peers must prove they know.
    pub secret: Vec<u8>,
    /// Where to listen (`127.0.0.1:0` picks a port).
    pub bind: SocketAddr,
    /// How long offered blocks are held without a COMPLETE.
    pub lease: Duration,
    /// Bound on every socket read and write.
    pub io_timeout: Duration,
    /// Offer the region's shared-memory handle to peers on this host.
    pub share_memory: bool,
    /// This side's KV arena in device memory, if its engine keeps one: its handle is offered
    /// to peers on this host, and pushes to a peer whose arena is on a device too go device
    /// to device.
    pub device: Option<Arc<dyn DeviceArena>>,
    /// Longest a peer may take over its whole handshake (CONNECT and AUTH) before it has proved
    /// it knows the secret.
    pub handshake_timeout: Duration,
    /// Most connections at once, authenticated or not: a connection over the cap is closed at
    /// once, costing no thread.
    pub max_connections: usize,
    /// Most connections at once still in their handshake without a member ticket (a flood of
    /// connections holds at most this many threads, each for at most `handshake_timeout`; one
    /// that sends no ticket holds none, only a place among the connections waiting for one).
    pub max_handshakes: usize,
    /// Most of those from one IP address: a flood from one host cannot take every stranger
    /// slot from the others.
    pub max_handshakes_per_peer: usize,
    /// Most handshakes at once of connections that opened with a valid member ticket
    /// (`admit.rs`): slots of their own, which no connection without one takes, whatever
    /// address it comes from (a member over them takes a stranger slot).
    pub max_member_handshakes: usize,
    /// Speak TLS with this configuration (a peer must then connect with TLS and trust our
    /// certificate); the TLS handshake counts against `handshake_timeout`.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// Where the bytes this side sends out of its arena are counted: over TCP or into a peer's
    /// mapping device to host, over a device link device to device (the engine's meter).
    pub meter: Arc<baton_kv::CopyMeter>,
}

/// Most metadata a frame may carry before its sender is authenticated (a CONNECT's endpoint
/// facts take a few hundred bytes).
pub const HANDSHAKE_MAX_META: usize = 64 << 10;

impl ServerConfig {
    /// Defaults: loopback, any port, 30 s leases, 10 s I/O timeout, shared memory offered, a 5 s
    /// handshake, at most 256 connections of which 16 members and 16 strangers in their
    /// handshake (4 strangers from one address), no TLS.
    pub fn new(peer: PeerId, compat: Compat, secret: impl Into<Vec<u8>>) -> Self {
        Self {
            peer,
            compat,
            secret: secret.into(),
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            lease: Duration::from_secs(30),
            io_timeout: Duration::from_secs(10),
            share_memory: true,
            device: None,
            handshake_timeout: Duration::from_secs(5),
            max_connections: 256,
            max_handshakes: 16,
            max_handshakes_per_peer: 4,
            max_member_handshakes: 16,
            tls: None,
            meter: Arc::default(),
        }
    }
}

/// Where a push's source blocks come from.
#[derive(Clone, Copy)]
enum PushSource<'a> {
    /// The transfer's lease.
    Leased,
    /// Blocks the caller holds: positions `first..` of the transfer.
    Blocks { src: &'a [BlockId], first: usize },
}

/// A decode side waiting for pushed KV.
struct PushTarget {
    conn_no: u64,
    /// Tells a reservation from a later one under the same id.
    serial: u64,
    /// The decode side's number for the reservation, named in every WRITE and PUSHED.
    generation: u64,
    dst_blocks: Vec<BlockId>,
    peer: EndpointInfo,
    writer: Arc<Mutex<Conn>>,
    way: PushWay,
}

struct Shared {
    config: ServerConfig,
    region: Region,
    owner: Box<dyn BlockOwner>,
    leases: Mutex<LeaseTable>,
    epoch: Instant,
    stop: AtomicBool,
    pushes: Mutex<HashMap<TransferId, PushTarget>>,
    push_ready: Condvar,
    conns: Mutex<HashMap<u64, Conn>>,
    /// Connections in their handshake, in all and by peer address ([`HandshakeSlot`]).
    handshaking: Mutex<Handshaking>,
    next_conn: AtomicU64,
    next_push: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    fn now(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn lease_ms(&self) -> u64 {
        self.config.lease.as_millis() as u64
    }

    /// Ends due leases and hands their blocks back (outside the lock).
    fn expire(&self) {
        let released = lock(&self.leases).expire(self.now());
        for r in released {
            self.owner.release(r);
        }
    }

    fn info(&self) -> EndpointInfo {
        EndpointInfo {
            peer: self.config.peer,
            compat: self.config.compat.clone(),
            compat_hash: self.config.compat.hash(),
            descriptor: self.region.descriptor().clone(),
            region_len: self.region.len() as u64,
            reach: Reach {
                host: Some(HostId::this()),
                location: self.config.device.as_ref().map_or(Location::Host, |d| d.location()),
                shm: if self.config.share_memory { self.region.shm_handle() } else { None },
                device: self.config.device.as_ref().map(|d| d.handle()),
            },
        }
    }

    /// How this server writes a push into `peer`'s blocks: the fastest way the peer offered
    /// ([`choose`] over what it sent at CONNECT), falling back when one cannot be opened. Found
    /// once per connection, at its first push.
    fn push_way(&self, peer: &EndpointInfo) -> PushWay {
        let ours = self.info().reach;
        let kinds = choose(&ours, &peer.reach, TransportChoice::Auto).unwrap_or_else(|_| vec![TransportKind::Tcp]);
        for kind in kinds {
            let opened = match kind {
                TransportKind::Device => match (&self.config.device, &peer.reach.device) {
                    (Some(ours), Some(theirs)) => ours.open(theirs, &peer.descriptor).map(|l| {
                        // Only a link that does not hold the peer's memory needs its process alive.
                        let watch = if l.outlives_exporter() { None } else { ProcessWatch::new(theirs.pid) };
                        PushWay::Device(l.into(), watch.map(Arc::new))
                    }),
                    _ => continue,
                },
                TransportKind::Shm => match peer.reach.shm {
                    Some(h) => Region::open(&h, peer.descriptor.clone(), Access::ReadWrite)
                        .map(|r| PushWay::Shm(Arc::new(r)))
                        .map_err(TransferError::io("mapping the decode side's region")),
                    None => continue,
                },
                TransportKind::Tcp => return PushWay::Tcp,
            };
            match opened {
                Ok(way) => return way,
                Err(e) => {
                    tracing::info!(peer = %peer.peer, transport = %kind, error = %e, "cannot push this way; trying the next")
                }
            }
        }
        PushWay::Tcp
    }
}

/// How a push reaches the decode side's blocks.
#[derive(Debug, Clone)]
enum PushWay {
    /// Device to device, into the peer's device arena; with a watch (a link that does not hold
    /// the peer's memory), while the process that exported it lives; without, while its
    /// connection does (a push into memory the link holds is harmless once the peer is gone).
    Device(Arc<dyn DeviceLink>, Option<Arc<ProcessWatch>>),
    /// `memcpy` into the peer's region, mapped here.
    Shm(Arc<Region>),
    /// WRITE frames on the control connection.
    Tcp,
}

/// A prefill worker's KV server (see the module docs). Dropping it stops its threads.
pub struct KvServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for KvServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvServer").field("addr", &self.addr).field("peer", &self.shared.config.peer).finish()
    }
}

impl KvServer {
    /// Serves `region` (e.g. `Region::from_arena(&pool.arena().handle()?, Access::ReadOnly)`);
    /// `owner` gets blocks back as leases end.
    pub fn start(config: ServerConfig, region: Region, owner: impl BlockOwner) -> Result<KvServer> {
        config.compat.check_descriptor(region.descriptor()).map_err(TransferError::Incompatible)?;
        let listener = TcpListener::bind(config.bind).map_err(TransferError::io("binding the KV server"))?;
        let addr = listener.local_addr().map_err(TransferError::io("binding the KV server"))?;
        let shared = Arc::new(Shared {
            config,
            region,
            owner: Box::new(owner),
            leases: Mutex::new(LeaseTable::new()),
            epoch: Instant::now(),
            stop: AtomicBool::new(false),
            pushes: Mutex::new(HashMap::new()),
            push_ready: Condvar::new(),
            conns: Mutex::new(HashMap::new()),
            handshaking: Mutex::default(),
            next_conn: AtomicU64::new(1),
            next_push: AtomicU64::new(1),
        });
        let acceptor = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("kv-accept".into())
                .spawn(move || accept_loop(&shared, &listener))
                .map_err(TransferError::io("spawning the KV server"))?
        };
        let reaper = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("kv-leases".into())
                .spawn(move || {
                    while !shared.stop.load(Ordering::Acquire) {
                        std::thread::sleep(Duration::from_millis(5));
                        shared.expire();
                    }
                })
                .map_err(TransferError::io("spawning the KV server"))?
        };
        Ok(KvServer { shared, addr, threads: vec![acceptor, reaper] })
    }

    /// Where peers connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// What this server tells peers at CONNECT.
    pub fn info(&self) -> EndpointInfo {
        self.shared.info()
    }

    /// The served region.
    pub fn region(&self) -> &Region {
        &self.shared.region
    }

    /// Pull mode: holds `blocks` for transfer `id` under a lease until the decode side
    /// completes or the lease runs out; either way they come back through the [`BlockOwner`].
    pub fn offer(&self, id: TransferId, blocks: Vec<BlockId>) -> Result<()> {
        let now = self.shared.now();
        lock(&self.shared.leases).offer(id, blocks, now, self.shared.lease_ms())?;
        Ok(())
    }

    /// Withdraws an offer; its blocks go back to the owner at once.
    pub fn cancel(&self, id: TransferId) -> bool {
        let released = lock(&self.shared.leases).cancel(id);
        released.map(|r| self.shared.owner.release(r)).is_some()
    }

    /// Leases currently held.
    pub fn live_leases(&self) -> usize {
        self.shared.expire();
        lock(&self.shared.leases).len()
    }

    /// Push mode: writes `layers` of `src_blocks` into the blocks the decode side reserved for
    /// `id` (waiting up to `wait` for its TRANSFER), over shared memory when the decode side
    /// offered its region, else as WRITE frames. The first call leases `src_blocks`; the
    /// decode side's COMPLETE, after the last layer, releases them.
    pub fn push(
        &self,
        id: TransferId,
        src_blocks: &[BlockId],
        layers: Range<usize>,
        wait: Duration,
    ) -> Result<TransferStats> {
        {
            let s = &self.shared;
            let now = s.now();
            let mut leases = lock(&s.leases);
            if leases.blocks(id, now).is_err() {
                leases.offer(id, src_blocks.to_vec(), now, s.lease_ms())?;
            }
        }
        self.push_offered(id, layers, wait)
    }

    /// Push mode for blocks already under a lease ([`offer`](Self::offer)): writes `layers` of
    /// them into the blocks the decode side reserved for `id`, waiting up to `wait` for its
    /// TRANSFER. Fails without writing anything when the lease ends first (COMPLETE, cancel or
    /// expiry) or the decode side withdrew its reservation (COMPLETE, or its connection
    /// closed); once the decode side has the answer to its COMPLETE, or has seen its
    /// connection close, no write of this server reaches its blocks any more.
    pub fn push_offered(&self, id: TransferId, layers: Range<usize>, wait: Duration) -> Result<TransferStats> {
        let layers_total = self.shared.region.descriptor().extent(Dim::Layer);
        let done = layers.end == layers_total;
        self.push_into(id, PushSource::Leased, layers, wait, done.then_some(&[]))
    }

    /// Layer-wise push, one piece: writes `layers` of `src`, which are the blocks at positions
    /// `first..first + src.len()` of the transfer (held by the caller, not under a lease: the
    /// prefill is still computing the later blocks), into the matching blocks the decode side
    /// reserved for `id`, and reports them with a PUSHED that is not the last. Waits up to `wait`
    /// for the decode side's TRANSFER (`Duration::ZERO`: a [`TransferError::Timeout`] at once
    /// when it has not come yet, and nothing is written). A block may be pushed again (a
    /// prefill recomputed after a preemption): the last write wins.
    /// [`finish_layers`](Self::finish_layers) ends the push.
    pub fn push_blocks(
        &self,
        id: TransferId,
        src: &[BlockId],
        first: usize,
        layers: Range<usize>,
        wait: Duration,
    ) -> Result<TransferStats> {
        self.push_into(id, PushSource::Blocks { src, first }, layers, wait, None)
    }

    /// Ends a layer-wise push: tells the decode side that every layer of every block is in place
    /// (the last PUSHED), handing it `trailer` with it. Waits like
    /// [`push_blocks`](Self::push_blocks); the decode side then COMPLETEs, which ends the lease
    /// on the blocks if they were [`offer`](Self::offer)ed meanwhile.
    pub fn finish_layers(&self, id: TransferId, trailer: &[u32], wait: Duration) -> Result<TransferStats> {
        let layers_total = self.shared.region.descriptor().extent(Dim::Layer);
        self.push_into(id, PushSource::Blocks { src: &[], first: 0 }, layers_total..layers_total, wait, Some(trailer))
    }

    /// Writes `layers` of `source` into the decode side's reservation for `id`, then a PUSHED
    /// (the last one, with its trailer, when `last` is given).
    fn push_into(
        &self,
        id: TransferId,
        source: PushSource<'_>,
        layers: Range<usize>,
        wait: Duration,
        last: Option<&[u32]>,
    ) -> Result<TransferStats> {
        let start = Instant::now();
        let s = &self.shared;
        let deadline = Instant::now() + wait;
        let (src_blocks, (serial, generation), dst_blocks, descriptor, writer, way) = {
            let mut pushes = lock(&s.pushes);
            loop {
                // Lock order: pushes, then leases.
                let src = match source {
                    PushSource::Leased => lock(&s.leases).blocks(id, s.now()).map(<[BlockId]>::to_vec)?,
                    PushSource::Blocks { src, .. } => src.to_vec(),
                };
                if let Some(t) = pushes.get(&id) {
                    let target = ((t.serial, t.generation), t.dst_blocks.clone(), t.peer.descriptor.clone());
                    break (src, target.0, target.1, target.2, Arc::clone(&t.writer), t.way.clone());
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(TransferError::Timeout {
                        context: "waiting for the decode side to reserve blocks",
                        millis: wait.as_millis() as u64,
                    });
                }
                // In slices, so a lease that ends meanwhile is noticed without a wake-up.
                let slice = left.min(Duration::from_millis(20));
                pushes = s.push_ready.wait_timeout(pushes, slice).unwrap_or_else(PoisonError::into_inner).0;
            }
        };
        let first = match source {
            PushSource::Leased => 0,
            PushSource::Blocks { first, .. } => first,
        };
        let Some(dst) = dst_blocks.get(first..first + src_blocks.len()) else {
            return Err(TransferError::Protocol(format!(
                "push {id}: blocks {first}..{} of a reservation of {}",
                first + src_blocks.len(),
                dst_blocks.len()
            )));
        };
        let p = plan_layers(s.region.descriptor(), &src_blocks, &descriptor, dst, layers.clone())?;
        // The writer's lock is held from the check that the reservation still stands to the
        // last byte: the answer to the decode side's COMPLETE goes out under the same lock, so
        // it can never overtake a write.
        let mut w = lock(&writer);
        if lock(&s.pushes).get(&id).is_none_or(|t| t.serial != serial) {
            return Err(TransferError::Remote {
                peer: s.config.peer,
                id,
                code: ErrorCode::UnknownTransfer,
                message: "the decode side withdrew its reservation".into(),
            });
        }
        let transport = match &way {
            PushWay::Device(..) => TransportKind::Device,
            PushWay::Shm(_) => TransportKind::Shm,
            PushWay::Tcp => TransportKind::Tcp,
        };
        let calls = match &way {
            PushWay::Device(link, watch) => {
                // Writing into a dead process's device memory could land in another's.
                if watch.as_ref().is_some_and(|w| !w.alive()) {
                    return Err(TransferError::Unavailable("the decode side's process has exited"));
                }
                link.push(&p.copies)?;
                s.config.meter.add(CopyDirection::DeviceToDevice, p.bytes() as u64);
                p.copies.len()
            }
            PushWay::Shm(dst) => {
                for c in &p.copies {
                    dst.copy_from(&s.region, c.src, c.dst)?;
                }
                s.config.meter.add(CopyDirection::DeviceToHost, p.bytes() as u64);
                p.copies.len()
            }
            PushWay::Tcp => {
                let batches = p.copies.chunks(4096);
                let n = batches.len();
                for batch in batches {
                    let dst: Vec<ByteRange> = batch.iter().map(|c| c.dst).collect();
                    let src: Vec<ByteRange> = batch.iter().map(|c| c.src).collect();
                    let payload_len = src.iter().map(|r| r.len as u64).sum();
                    let write = |sums| Frame::Write { id, generation, ranges: dst, payload_len, sums };
                    w.send_checked(write, &s.region, &src)?;
                    s.config.meter.add(CopyDirection::DeviceToHost, payload_len);
                }
                n
            }
        };
        let trailer = last.map(<[u32]>::to_vec).unwrap_or_default();
        let pushed = Frame::Pushed {
            id,
            generation,
            layers_done: layers.end as u32,
            done: last.is_some(),
            trailer,
            via: transport,
        };
        w.send(&pushed)?;
        Ok(TransferStats { bytes: p.bytes() as u64, copies: p.len(), calls, elapsed: start.elapsed(), transport })
    }

    /// Stops accepting, closes every connection and joins the server's threads.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        // Wake the acceptor with a connection of our own; if that fails it is already gone.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        for c in lock(&self.shared.conns).values() {
            c.shutdown();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for KvServer {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.stop();
        }
    }
}

/// Connections in their handshake: members, and strangers in all and from each address.
#[derive(Default)]
struct Handshaking {
    members: usize,
    total: usize,
    by_peer: HashMap<std::net::IpAddr, usize>,
}

/// One connection's place among those in their handshake, given back by `Drop` when the
/// handshake ends (either way) or the connection never starts.
struct HandshakeSlot {
    shared: Arc<Shared>,
    /// A stranger's address; `None` for a member's slot.
    stranger: Option<std::net::IpAddr>,
}

impl HandshakeSlot {
    /// A member's place, if the members' allowance has room.
    fn member(shared: &Arc<Shared>) -> Option<Self> {
        let mut h = lock(&shared.handshaking);
        if h.members >= shared.config.max_member_handshakes {
            return None;
        }
        h.members += 1;
        Some(Self { shared: Arc::clone(shared), stranger: None })
    }

    /// A stranger's place for a connection from `peer`, if both the server's and the address's
    /// allowance have room.
    fn stranger(shared: &Arc<Shared>, peer: std::net::IpAddr) -> Option<Self> {
        let mut h = lock(&shared.handshaking);
        let from_peer = h.by_peer.get(&peer).copied().unwrap_or(0);
        if h.total >= shared.config.max_handshakes || from_peer >= shared.config.max_handshakes_per_peer {
            return None;
        }
        h.total += 1;
        h.by_peer.insert(peer, from_peer + 1);
        Some(Self { shared: Arc::clone(shared), stranger: Some(peer) })
    }
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        let mut h = lock(&self.shared.handshaking);
        let Some(peer) = self.stranger else {
            h.members -= 1;
            return;
        };
        h.total -= 1;
        if let Some(n) = h.by_peer.get_mut(&peer) {
            *n -= 1;
            if *n == 0 {
                h.by_peer.remove(&peer);
            }
        }
    }
}

/// Most connections waiting for their member ticket at once (`admit.rs`): past it the oldest is
/// closed. Each is a descriptor and 100 bytes, no thread.
const MAX_TRIAGE: usize = 256;

/// Most connections accepted before the triage reads what the waiting ones sent.
const ACCEPT_BATCH: usize = 32;

/// Accepts connections, sorts them by their ticket ([`Triage`], [`Tickets`]) and starts a
/// thread for each that gets a handshake slot; the rest are closed.
fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
    if let Err(e) = listener.set_nonblocking(true) {
        tracing::error!(error = %e, "the KV server cannot poll its listener; it accepts nothing");
        return;
    }
    let mut triage = Triage::new(MAX_TRIAGE, shared.config.handshake_timeout);
    let mut tickets = Tickets::default();
    while !shared.stop.load(Ordering::Acquire) {
        let mut ready = Vec::new();
        if triage.poll(listener, Duration::from_millis(100)) {
            // A batch at a time, the tickets read between batches: a flood that keeps the
            // listener busy cannot push a member's connection out of the triage unread.
            for _ in 0..ACCEPT_BATCH {
                let (stream, peer) = match listener.accept() {
                    Ok(s) => s,
                    // WouldBlock: no more for now; anything else (out of descriptors): next round.
                    Err(_) => break,
                };
                // Dropping the stream closes it: a flood costs no thread and no memory.
                if lock(&shared.conns).len() >= shared.config.max_connections {
                    continue;
                }
                ready.extend(triage.add(stream, peer, Instant::now()));
            }
        }
        ready.extend(triage.collect(Instant::now()));
        for t in ready {
            let now_ms =
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
            let slot = match tickets.admit(auth::check_ticket(&shared.config.secret, &t.ticket), now_ms) {
                Admission::Member => {
                    HandshakeSlot::member(shared).or_else(|| HandshakeSlot::stranger(shared, t.peer.ip()))
                }
                Admission::Stranger => HandshakeSlot::stranger(shared, t.peer.ip()),
                Admission::Refuse => None,
            };
            if let Some(slot) = slot {
                start_conn(shared, t.stream, slot);
            }
        }
    }
}

/// Starts the thread serving a connection that holds a handshake slot.
fn start_conn(shared: &Arc<Shared>, stream: TcpStream, slot: HandshakeSlot) {
    let Ok(conn) = Conn::new(stream, shared.config.io_timeout) else { return };
    let no = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    if let Ok(c) = conn.try_clone() {
        lock(&shared.conns).insert(no, c);
    }
    let s = Arc::clone(shared);
    let spawned = std::thread::Builder::new().name("kv-conn".into()).spawn(move || {
        // A connection's failure is the peer's business; the leases it opened run out.
        let _ = serve(&s, conn, no, slot);
        lock(&s.conns).remove(&no);
        lock(&s.pushes).retain(|_, t| t.conn_no != no);
    });
    if spawned.is_err() {
        lock(&shared.conns).remove(&no);
    }
}

/// CONNECT, CHALLENGE, AUTH, ACCEPT from the server's side; returns the client's facts.
fn handshake(shared: &Shared, conn: &mut Conn) -> Result<EndpointInfo> {
    let refuse = |conn: &mut Conn, code: ErrorCode, message: String| {
        // Best effort: the peer may already be gone.
        let _ = conn.send(&Frame::Error { id: TransferId(0), code, message });
    };
    let deadline = Instant::now() + shared.config.handshake_timeout;
    if let Some(tls) = &shared.config.tls {
        conn.start_tls_server(Arc::clone(tls), deadline)?;
    }
    let (info, client_nonce) = match conn.recv_handshake(deadline, HANDSHAKE_MAX_META)? {
        Frame::Connect { info, nonce } => (info, nonce),
        other => {
            let m = format!("expected CONNECT, got {}", other.name());
            refuse(conn, ErrorCode::Protocol, m.clone());
            return Err(TransferError::Protocol(m));
        }
    };
    let server_nonce = auth::nonce();
    let proof = auth::proof(&shared.config.secret, Side::Server, &client_nonce, &server_nonce);
    conn.send(&Frame::Challenge { nonce: server_nonce, proof })?;
    let want = auth::proof(&shared.config.secret, Side::Client, &client_nonce, &server_nonce);
    match conn.recv_handshake(deadline, HANDSHAKE_MAX_META)? {
        Frame::Auth { proof } if auth::proofs_equal(&proof, &want) => {}
        _ => {
            refuse(conn, ErrorCode::AuthFailed, "the peer does not know the cluster secret".into());
            return Err(TransferError::AuthFailed("the client does not know the cluster secret"));
        }
    }
    // Only now, the peer proven a member, is it told how it does not fit: a stranger learns
    // nothing of what this side serves (the model, the KV layout).
    if let Err(m) = check_peer(&shared.config.compat, &info) {
        refuse(conn, ErrorCode::Incompatible, m.clone());
        return Err(TransferError::Incompatible(m));
    }
    conn.send(&Frame::Accept { info: shared.info() })?;
    Ok(info)
}

fn lease_code(e: &LeaseError) -> ErrorCode {
    match e {
        LeaseError::Unknown(_) => ErrorCode::UnknownTransfer,
        LeaseError::Expired(_) => ErrorCode::LeaseExpired,
        LeaseError::Duplicate(_) => ErrorCode::Protocol,
        LeaseError::NotLeased { .. } => ErrorCode::OutOfBounds,
    }
}

/// Byte ranges of `blocks`, sorted and merged, for containment checks.
fn leased_ranges(shared: &Shared, blocks: &[BlockId]) -> Vec<ByteRange> {
    let mut r = shared.region.descriptor().byte_ranges(blocks);
    r.sort_unstable();
    let mut out: Vec<ByteRange> = Vec::with_capacity(r.len());
    for x in r {
        match out.last_mut() {
            Some(last) if last.end() >= x.offset => last.len = last.len.max(x.end() - last.offset),
            _ => out.push(x),
        }
    }
    out
}

fn contained(allowed: &[ByteRange], r: &ByteRange) -> bool {
    let i = allowed.partition_point(|a| a.offset <= r.offset);
    i > 0 && allowed[i - 1].end() >= r.end()
}

fn serve(shared: &Arc<Shared>, mut conn: Conn, conn_no: u64, slot: HandshakeSlot) -> Result<()> {
    let peer = handshake(shared, &mut conn);
    drop(slot);
    let peer = peer?;
    let writer = Arc::new(Mutex::new(conn.try_clone()?));
    let send = |f: &Frame| lock(&writer).send(f);
    let mut allowed: HashMap<TransferId, Vec<ByteRange>> = HashMap::new();
    let mut gather: Vec<u8> = Vec::new();
    let mut push_way: Option<PushWay> = None;
    loop {
        if shared.stop.load(Ordering::Acquire) {
            return Ok(());
        }
        if !conn.readable(Duration::from_millis(100))? {
            continue;
        }
        match conn.recv()? {
            Frame::Transfer { id, mode: TransferMode::Pull, remote, .. } => {
                let blocks: Vec<BlockId> = remote.into_iter().map(BlockId).collect();
                let now = shared.now();
                let opened = lock(&shared.leases).open(id, &blocks, now);
                match opened {
                    Ok(()) => {
                        allowed.insert(id, leased_ranges(shared, &blocks));
                        send(&Frame::TransferOk { id })?;
                    }
                    Err(e) => send(&Frame::Error { id, code: lease_code(&e), message: e.to_string() })?,
                }
            }
            Frame::Transfer { id, mode: TransferMode::Push, local, generation, .. } => {
                let way = push_way.get_or_insert_with(|| shared.push_way(&peer)).clone();
                let target = PushTarget {
                    conn_no,
                    serial: shared.next_push.fetch_add(1, Ordering::Relaxed),
                    generation,
                    dst_blocks: local.into_iter().map(BlockId).collect(),
                    peer: peer.clone(),
                    writer: Arc::clone(&writer),
                    way,
                };
                lock(&shared.pushes).insert(id, target);
                shared.push_ready.notify_all();
                send(&Frame::TransferOk { id })?;
            }
            Frame::Read { id, seq, ranges, flags } => {
                let now = shared.now();
                let check = {
                    let leases = lock(&shared.leases);
                    leases.blocks(id, now).map(|b| {
                        allowed.entry(id).or_insert_with(|| leased_ranges(shared, b));
                    })
                };
                if let Err(e) = check {
                    send(&Frame::Error { id, code: lease_code(&e), message: e.to_string() })?;
                    continue;
                }
                let ok = allowed.get(&id).is_some_and(|a| ranges.iter().all(|r| contained(a, r)));
                if !ok {
                    let message = "READ outside the blocks leased to this transfer".to_string();
                    send(&Frame::Error { id, code: ErrorCode::OutOfBounds, message })?;
                    continue;
                }
                let payload_len = ranges.iter().map(|r| r.len as u64).sum();
                shared.config.meter.add(CopyDirection::DeviceToHost, payload_len);
                let data = |sums| Frame::Data { id, seq, payload_len, sums };
                if flags & FLAG_GATHER != 0 {
                    // The message-passing baseline: gather into a (reused) buffer, then send it.
                    gather.clear();
                    let mut sums = Vec::with_capacity(ranges.len());
                    for r in &ranges {
                        shared.region.with_bytes(*r, |b| {
                            sums.push(crc32c::crc32c(b));
                            gather.extend_from_slice(b);
                        })?;
                    }
                    lock(&writer).send_with_bytes(&data(sums), &gather)?;
                } else {
                    lock(&writer).send_checked(data, &shared.region, &ranges)?;
                }
            }
            Frame::Complete { id } => {
                allowed.remove(&id);
                lock(&shared.pushes).remove(&id);
                let now = shared.now();
                let done = lock(&shared.leases).complete(id, now);
                match done {
                    Ok(release) => {
                        shared.owner.release(release);
                        send(&Frame::CompleteAck { id })?;
                    }
                    Err(e) => send(&Frame::Error { id, code: lease_code(&e), message: e.to_string() })?,
                }
            }
            other => {
                let message = format!("unexpected {} from a client", other.name());
                send(&Frame::Error { id: TransferId(0), code: ErrorCode::Protocol, message: message.clone() })?;
                return Err(TransferError::Protocol(message));
            }
        }
    }
}
