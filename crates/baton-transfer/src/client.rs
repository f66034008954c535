//! The decode side: a connection to one prefill worker's [`KvServer`](crate::KvServer).
//!
//! [`KvClient::connect`] opens each connection with a member ticket (`auth::ticket`), then
//! performs CONNECT (descriptors, geometry, compatibility hash, proofs of the cluster secret) on
//! a control connection, plus the data connections of the chosen
//! transport. Then, per request: [`KvClient::pull`] = TRANSFER + coalesced reads + COMPLETE
//! (or the three steps separately, to keep many transfers in flight), or, in push mode,
//! [`KvClient::begin_push`] and [`KvClient::finish_push`].
//!
//! On any error the destination blocks' contents are undefined and the caller frees them; the
//! prefill side's lease runs out on its own. A successful COMPLETE proves the source blocks were
//! held for the whole transfer, so no stale byte is ever accepted.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_kv::{BlockId, ByteRange};

use crate::auth::{self, Side};
use crate::compat::Compat;
use crate::conn::{Conn, damaged_blocks};
use crate::device::DeviceArena;
use crate::frame::{EndpointInfo, FLAG_GATHER, Frame, TransferMode, check_peer};
use crate::location::{HostId, Location, Reach, TransportChoice, choose};
use crate::plan::{RangeCopy, plan};
use crate::region::{Access, Region};
use crate::transport::{DeviceTransport, ShmTransport, TcpLimits, TcpTransport, Transport, TransportKind};
use crate::{PeerId, Result, TransferError, TransferId, TransferStats};

/// Configuration of a [`KvClient`].
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// This worker.
    pub peer: PeerId,
    /// Model, geometry and layout version expected.
    pub compat: Compat,
    /// The cluster secret.
    pub secret: Vec<u8>,
    /// How data moves: a transport to insist on, or the fastest the two sides share
    /// ([`TransportChoice::Auto`]). This side offers the peer (for pushes) only the handles the
    /// choice allows.
    pub transport: TransportChoice,
    /// This side's KV arena in device memory, if its engine keeps one a peer may open (the
    /// device transport's destination).
    pub device: Option<Arc<dyn DeviceArena>>,
    /// TCP data connections (ignored for the other transports).
    pub connections: usize,
    /// Bound on every socket read and write, and on connecting.
    pub io_timeout: Duration,
    /// READ batching of the TCP transport.
    pub tcp: TcpLimits,
    /// Speak TLS with this configuration, checking the server's certificate against the
    /// address dialled (every connection, the control one included).
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// Where the bytes read into this side's arena are counted: device to device over a device
    /// link, host to device otherwise (the engine's meter).
    pub meter: Arc<baton_kv::CopyMeter>,
}

impl ClientConfig {
    /// This side's facts as CONNECT says them: its host, where its KV lives, and the handles
    /// `transport` lets it offer.
    fn reach(&self, local: &Region) -> Reach {
        Reach {
            host: Some(HostId::this()),
            location: self.device.as_ref().map_or(Location::Host, |d| d.location()),
            shm: if self.transport.offers_shm() { local.shm_handle() } else { None },
            device: self.device.as_ref().filter(|_| self.transport.offers_device()).map(|d| d.handle()),
        }
    }

    /// Defaults: TCP, one data connection, 10 s I/O timeout, no TLS.
    pub fn new(peer: PeerId, compat: Compat, secret: impl Into<Vec<u8>>) -> Self {
        Self {
            peer,
            compat,
            secret: secret.into(),
            transport: TransportChoice::Tcp,
            device: None,
            connections: 1,
            io_timeout: Duration::from_secs(10),
            tcp: TcpLimits::default(),
            tls: None,
            meter: Arc::default(),
        }
    }
}

/// What one message of the naive message-passing transfer moves
/// ([`KvClient::pull_naive_by`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NaiveUnit {
    /// One whole block: every layer's K and V slab of it, gathered into one message.
    Block,
    /// One `(block, layer, K/V)` slab `[T][H][D]` (32 KiB at Llama-3-8B's geometry, f16): the
    /// contiguous piece a layer-major (vLLM) cache holds, which a message-passing library
    /// (UCX, NCCL, MPI) sends one message at a time. KVDirect's baseline (§3, Fig. 3–4: 4–32 KB
    /// "blocks" of one layer; §6, Fig. 15: message-based transfer over UCX).
    Slab,
}

impl PushState {
    /// Bytes the push moved: what its WRITEs carried, or, one-sided, the blocks registered.
    fn moved(&self) -> u64 {
        if self.bytes == 0 && self.done { self.registered } else { self.bytes }
    }
}

#[derive(Debug, Default, Clone)]
struct PushState {
    /// The reservation this push writes into.
    generation: u64,
    layers_done: u32,
    done: bool,
    bytes: u64,
    frames: usize,
    /// PUSHED frames received: a layer-wise push's progress.
    pushed: u64,
    /// What the last PUSHED handed over with the data.
    trailer: Vec<u32>,
    /// Bytes of the blocks registered.
    registered: u64,
    /// How the pusher wrote, as its last PUSHED said.
    via: Option<TransportKind>,
}

/// A decode worker's link to one prefill worker (see the module docs).
pub struct KvClient {
    config: ClientConfig,
    control: Conn,
    remote: EndpointInfo,
    local: Arc<Region>,
    transport: Box<dyn Transport>,
    pushes: HashMap<TransferId, PushState>,
    /// WRITE frames refused because they named no live push or an earlier reservation.
    stale_writes: u64,
}

impl std::fmt::Debug for KvClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvClient")
            .field("remote", &self.remote.peer)
            .field("transport", &self.transport.kind())
            .finish()
    }
}

impl KvClient {
    /// Connects to the KV server at `addr`; `local` is this worker's own region (the
    /// destination of every transfer, e.g. `Region::from_arena(&handle, Access::ReadWrite)`).
    pub fn connect(addr: SocketAddr, config: ClientConfig, local: Arc<Region>) -> Result<KvClient> {
        config.compat.check_descriptor(local.descriptor()).map_err(TransferError::Incompatible)?;
        if !local.is_writable() {
            return Err(TransferError::Unavailable("the destination region is mapped read-only"));
        }
        let ours = config.reach(&local);
        let (control, remote) = dial(addr, &config, &local, &ours)?;
        let kinds = choose(&ours, &remote.reach, config.transport).map_err(TransferError::Unreachable)?;
        // The fastest first; a transport that cannot be opened (a peer in another IPC or mount
        // namespace, a device that cannot map the other's memory) falls back to the next.
        let mut last = None;
        for kind in kinds {
            match open_transport(kind, addr, &config, &local, &remote) {
                Ok(transport) => {
                    let (pushes, stale_writes) = (HashMap::new(), 0);
                    return Ok(KvClient { config, control, remote, local, transport, pushes, stale_writes });
                }
                Err(e) => {
                    tracing::info!(peer = %addr, transport = %kind, error = %e, "transport unavailable; trying the next");
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or(TransferError::Unavailable("no transport reaches the peer")))
    }

    /// The prefill side's facts (descriptor, geometry, peer id).
    pub fn remote(&self) -> &EndpointInfo {
        &self.remote
    }

    /// The transport in use.
    pub fn transport(&self) -> TransportKind {
        self.transport.kind()
    }

    /// Whether the server is known to be gone, asked without waiting: its process exited
    /// ([`Transport::peer_exited`]: the same-host transports watch it), or it closed the
    /// control connection (a server that restarted, a host that went down cleanly). The client
    /// is then dead weight: its next transfer would fail, and its hold on the peer's arena — a
    /// mapped memfd, an imported CUDA VMM allocation: each stays allocated while any process
    /// holds it — is released only by dropping it.
    pub fn peer_gone(&self) -> bool {
        self.transport.peer_exited() || self.control.peer_closed()
    }

    /// Pull mode, all of it: TRANSFER, coalesced reads of `remote` blocks into `local` blocks,
    /// COMPLETE.
    ///
    /// Over shared memory, and over a device link that holds the peer's memory or whose
    /// exporting process lives, the reads do not wait for TRANSFER_OK, nor COMPLETE for the
    /// reads: TRANSFER, the reads and COMPLETE go out back to back and the two answers are
    /// awaited after, one round trip on the control connection instead of two. Safe because the blocks
    /// were leased when the prefill side offered them: TRANSFER succeeds only while that lease
    /// lives (it renews it; an ended lease is gone, and TRANSFER of it fails), and COMPLETE only
    /// while the renewed one does, so two successes mean the blocks were held from the offer
    /// until after the reads, and anything else discards what was read (the local blocks are
    /// this transfer's own); a dead peer's mapped region stays readable until unmapped, and so
    /// does an imported device arena (CUDA VMM, the stand-in). A dead exporter's legacy CUDA
    /// IPC memory is undefined to touch: that device link checks its pidfd just before the
    /// copy, a liveness proof as good as TRANSFER_OK (which also comes before the copy, and
    /// older), without the round trip; where it has none, the reads wait for TRANSFER_OK. Not
    /// over TCP: the reads are frames on the control connection, answered after TRANSFER_OK.
    pub fn pull(&mut self, id: TransferId, remote: &[BlockId], local: &[BlockId]) -> Result<TransferStats> {
        let start = Instant::now();
        if !self.transport.reads_before_answer() {
            self.open(id, remote, local)?;
            let mut stats = self.read(id, remote, local)?;
            self.complete(id)?;
            stats.elapsed = start.elapsed();
            return Ok(stats);
        }
        self.control.send(&pull_frame(id, remote, local))?;
        let read = self.read(id, remote, local);
        // Once TRANSFER is out, its answer must be taken off the connection whatever happens.
        let Ok(mut stats) = read else {
            let opened = self.expect(id, "TRANSFER_OK");
            return opened.and(read);
        };
        let completed = self.control.send(&Frame::Complete { id });
        let opened = self.expect(id, "TRANSFER_OK");
        // COMPLETE's answer too, so that the connection stays in step when TRANSFER failed
        // (the server answers both; a COMPLETE after a refused TRANSFER releases the offer).
        let acked = completed.and_then(|()| self.expect(id, "COMPLETE_ACK"));
        opened.and(acked)?;
        stats.elapsed = start.elapsed();
        Ok(stats)
    }

    /// TRANSFER: opens (and renews the lease of) transfer `id`. Many may be open at once.
    pub fn open(&mut self, id: TransferId, remote: &[BlockId], local: &[BlockId]) -> Result<()> {
        self.control.send(&pull_frame(id, remote, local))?;
        self.expect(id, "TRANSFER_OK")
    }

    /// Reads an open transfer's blocks with the fewest transport calls the layouts allow.
    pub fn read(&mut self, id: TransferId, remote: &[BlockId], local: &[BlockId]) -> Result<TransferStats> {
        let start = Instant::now();
        let p = plan(&self.remote.descriptor, remote, self.local.descriptor(), local)?;
        let calls = self.transport.read(id, &p.copies, &self.local)?;
        let direction = match self.transport.kind() {
            TransportKind::Device => baton_kv::CopyDirection::DeviceToDevice,
            TransportKind::Shm | TransportKind::Tcp => baton_kv::CopyDirection::HostToDevice,
        };
        self.config.meter.add(direction, p.bytes() as u64);
        Ok(TransferStats {
            bytes: p.bytes() as u64,
            copies: p.len(),
            calls,
            elapsed: start.elapsed(),
            transport: self.transport(),
        })
    }

    /// COMPLETE: the prefill side releases the blocks. An error here (the lease ran out) means
    /// the data read cannot be trusted.
    pub fn complete(&mut self, id: TransferId) -> Result<()> {
        self.control.send(&Frame::Complete { id })?;
        self.expect(id, "COMPLETE_ACK")
    }

    /// The naive message-passing transfer, one whole block per message (see
    /// [`pull_naive_by`](Self::pull_naive_by) with [`NaiveUnit::Block`]).
    pub fn pull_naive(&mut self, id: TransferId, remote: &[BlockId], local: &[BlockId]) -> Result<TransferStats> {
        self.pull_naive_by(id, remote, local, NaiveUnit::Block)
    }

    /// Message passing without the tensor-centric protocol: after TRANSFER, one
    /// request/response round trip per `unit` — the server gathers the unit's bytes into a
    /// buffer and sends it, this side receives it into a buffer and scatters it — then
    /// COMPLETE. Over the control connection, one message in flight at a time (KVDirect §3,
    /// Fig. 3 and Fig. 7a). [`NaiveUnit::Slab`] on a layer-major cache is KVDirect's baseline.
    /// Over a one-sided transport (device, shared memory) a unit is one transport call, each
    /// waited for before the next.
    pub fn pull_naive_by(
        &mut self,
        id: TransferId,
        remote: &[BlockId],
        local: &[BlockId],
        unit: NaiveUnit,
    ) -> Result<TransferStats> {
        let start = Instant::now();
        if remote.len() != local.len() {
            return Err(crate::PlanError::Lengths { src: remote.len(), dst: local.len() }.into());
        }
        self.open(id, remote, local)?;
        let slab = self.config.compat.geometry.slab_elems() * self.config.compat.geometry.dtype.size();
        let (mut bytes, mut copies, mut calls) = (0u64, 0usize, 0usize);
        let mut buf = Vec::new();
        for (&r, &l) in remote.iter().zip(local) {
            let p = plan(&self.remote.descriptor, &[r], self.local.descriptor(), &[l])?;
            match unit {
                // One-sided transports: one transport call a block, waited for.
                NaiveUnit::Block if self.transport.kind() != TransportKind::Tcp => {
                    calls += self.transport.read(id, &p.copies, &self.local)?;
                }
                NaiveUnit::Block => {
                    self.naive_message(id, calls as u64, &p.copies, &mut buf)?;
                    calls += 1;
                }
                NaiveUnit::Slab => {
                    // A block's runs are whole slabs on both sides (a slab is contiguous in
                    // every layout): one message per slab.
                    for c in &p.copies {
                        for at in (0..c.src.len).step_by(slab) {
                            let len = slab.min(c.src.len - at);
                            let piece = RangeCopy {
                                src: ByteRange { offset: c.src.offset + at, len },
                                dst: ByteRange { offset: c.dst.offset + at, len },
                            };
                            if self.transport.kind() == TransportKind::Tcp {
                                self.naive_message(id, calls as u64, &[piece], &mut buf)?;
                                calls += 1;
                            } else {
                                calls += self.transport.read(id, &[piece], &self.local)?;
                            }
                        }
                    }
                }
            }
            bytes += p.bytes() as u64;
            copies += p.len();
        }
        self.complete(id)?;
        Ok(TransferStats { bytes, copies, calls, elapsed: start.elapsed(), transport: self.transport() })
    }

    /// One naive round trip: READ (gathered) of the copies' sources, DATA into `buf`, scattered
    /// to the copies' destinations.
    fn naive_message(&mut self, id: TransferId, seq: u64, copies: &[RangeCopy], buf: &mut Vec<u8>) -> Result<()> {
        let ranges: Vec<ByteRange> = copies.iter().map(|c| c.src).collect();
        let len: usize = ranges.iter().map(|r| r.len).sum();
        self.control.send(&Frame::Read { id, seq, ranges, flags: FLAG_GATHER })?;
        let sums = match self.control.recv()? {
            Frame::Data { payload_len, sums, .. } if payload_len == len as u64 && sums.len() == copies.len() => {
                self.control.recv_buf(len, buf)?;
                sums
            }
            Frame::Error { id, code, message } => {
                return Err(TransferError::Remote { peer: self.remote.peer, id, code, message });
            }
            other => return Err(TransferError::Protocol(format!("expected DATA, got {}", other.name()))),
        };
        let mut at = 0;
        for c in copies {
            self.local.write(c.dst.offset, &buf[at..at + c.dst.len])?;
            at += c.dst.len;
        }
        let dst: Vec<ByteRange> = copies.iter().map(|c| c.dst).collect();
        match damaged_blocks(&self.local, &dst, &sums)? {
            0 => Ok(()),
            blocks => Err(TransferError::Corrupt { peer: self.remote.peer, id, blocks }),
        }
    }

    /// Push mode, first half: sends the ids of the blocks this side reserved for `id`, and the
    /// reservation's `generation` (a number this side never reuses for these blocks): a WRITE
    /// that names another generation, or a push no longer registered, is refused, its bytes
    /// read and dropped, so a late frame of an aborted push can never land in blocks reused since.
    pub fn begin_push(&mut self, id: TransferId, generation: u64, local: &[BlockId]) -> Result<()> {
        // One-sided writes (device or shared memory) send no frame to count: a push that ends
        // with no WRITE received filled every layer of the blocks registered.
        let registered = self.local.descriptor().byte_ranges(local).iter().map(|r| r.len as u64).sum();
        self.pushes.insert(id, PushState { generation, registered, ..PushState::default() });
        let frame = Frame::Transfer { id, mode: TransferMode::Push, remote: Vec::new(), local: ids(local), generation };
        let registered = self.control.send(&frame).and_then(|()| self.expect(id, "TRANSFER_OK"));
        if registered.is_err() {
            self.pushes.remove(&id);
        }
        registered
    }

    /// Push mode, second half: receives the prefill side's writes until its last layer, then
    /// COMPLETEs. Waits at most `wait` in all.
    pub fn finish_push(&mut self, id: TransferId, wait: Duration) -> Result<TransferStats> {
        let start = Instant::now();
        loop {
            if self.pushes.get(&id).is_some_and(|p| p.done) {
                break;
            }
            if start.elapsed() >= wait {
                return Err(TransferError::Timeout {
                    context: "waiting for pushed KV",
                    millis: wait.as_millis() as u64,
                });
            }
            if !self.control.readable(Duration::from_millis(50))? {
                continue;
            }
            let frame = self.control.recv()?;
            self.handle_async(frame)?;
        }
        let completed = self.complete(id);
        // Finished or refused, the push is over on both sides.
        let p = self.pushes.remove(&id).unwrap_or_default();
        completed?;
        let transport = p.via.unwrap_or(TransportKind::Tcp);
        Ok(TransferStats { bytes: p.moved(), copies: p.frames, calls: p.frames, elapsed: start.elapsed(), transport })
    }

    /// Push mode, for many pushes in flight: applies the prefill side's writes that arrive
    /// within `wait` (a zero `wait` only takes what is there) and returns the pushes whose
    /// last layer is in place; [`finish_push`](Self::finish_push) then completes each at once.
    pub fn poll_pushes(&mut self, wait: Duration) -> Result<Vec<TransferId>> {
        let mut poll = wait;
        while self.control.readable(poll)? {
            let frame = self.control.recv()?;
            self.handle_async(frame)?;
            poll = Duration::ZERO;
        }
        Ok(self.pushes.iter().filter(|(_, p)| p.done).map(|(&id, _)| id).collect())
    }

    /// Push mode: gives up push `id` (its requester went away, or it took too long). COMPLETE
    /// withdraws the reservation on the prefill side (and ends its lease there); once the
    /// answer arrives, whatever it says, the prefill side writes nothing more into the blocks
    /// reserved for `id`, and the caller may free them. An error leaves that unknown: the
    /// connection is then unusable, and only [`close`](Self::close) returning `true` makes
    /// the blocks safe to free.
    pub fn cancel_push(&mut self, id: TransferId) -> Result<()> {
        if !self.pushes.contains_key(&id) {
            return Ok(());
        }
        let answered = self.control.send(&Frame::Complete { id }).and_then(|()| self.expect(id, "COMPLETE_ACK"));
        self.pushes.remove(&id);
        match answered {
            Ok(()) => Ok(()),
            Err(TransferError::Remote { id: got, .. }) if got == id => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Closes the connection and waits up to `wait` for the prefill side to close its end;
    /// `true` when it did, which proves none of its pushes can still write into this side's
    /// region (it drops a connection's reservations before its last handle on it).
    pub fn close(mut self, wait: Duration) -> bool {
        self.control.close(wait)
    }

    /// WRITE frames refused so far because their push was over (withdrawn, or replaced by a
    /// later reservation under the same id).
    pub fn stale_writes(&self) -> u64 {
        self.stale_writes
    }

    /// Layers of push transfer `id` in place so far (of the blocks the last PUSHED reported).
    pub fn pushed_layers(&self, id: TransferId) -> Option<u32> {
        self.pushes.get(&id).map(|p| p.layers_done)
    }

    /// PUSHED frames received for push `id` so far: a layer-wise push, which reports each layer
    /// of each prefill chunk, is making progress while this grows.
    pub fn push_progress(&self, id: TransferId) -> Option<u64> {
        self.pushes.get(&id).map(|p| p.pushed)
    }

    /// What the last PUSHED of push `id` handed over (its trailer); empty before it came. Read
    /// it before [`finish_push`](Self::finish_push), which forgets the push.
    pub fn push_trailer(&self, id: TransferId) -> &[u32] {
        self.pushes.get(&id).map_or(&[], |p| p.trailer.as_slice())
    }

    /// Waits for the answer `what` to a request about `id`, applying pushed data that arrives
    /// in between.
    fn expect(&mut self, id: TransferId, what: &'static str) -> Result<()> {
        loop {
            match self.control.recv()? {
                Frame::TransferOk { id: got } | Frame::CompleteAck { id: got } if got == id => return Ok(()),
                Frame::Error { id: got, code, message } if got == id || got == TransferId(0) => {
                    return Err(TransferError::Remote { peer: self.remote.peer, id: got, code, message });
                }
                f @ (Frame::Write { .. } | Frame::Pushed { .. }) => self.handle_async(f)?,
                other => return Err(TransferError::Protocol(format!("expected {what}, got {}", other.name()))),
            }
        }
    }

    /// Applies a frame the server sends on its own (push mode).
    fn handle_async(&mut self, frame: Frame) -> Result<()> {
        match frame {
            Frame::Write { id, generation, ranges, payload_len, sums } => {
                let Some(state) = self.pushes.get_mut(&id).filter(|p| p.generation == generation) else {
                    // A stale write: its blocks may belong to another request by now.
                    self.stale_writes += 1;
                    return self.control.skip(payload_len);
                };
                if ranges.iter().map(|r| r.len as u64).sum::<u64>() != payload_len {
                    return Err(TransferError::Protocol(format!(
                        "WRITE for {id}: ranges and payload differ in length"
                    )));
                }
                state.bytes += payload_len;
                state.frames += 1;
                self.control.recv_into(&self.local, &ranges)?;
                self.config.meter.add(baton_kv::CopyDirection::HostToDevice, payload_len);
                match damaged_blocks(&self.local, &ranges, &sums)? {
                    0 => Ok(()),
                    blocks => Err(TransferError::Corrupt { peer: self.remote.peer, id, blocks }),
                }
            }
            Frame::Pushed { id, generation, layers_done, done, trailer, via } => {
                let Some(state) = self.pushes.get_mut(&id).filter(|p| p.generation == generation) else {
                    return Ok(());
                };
                state.via = Some(via);
                state.layers_done = layers_done;
                state.pushed += 1;
                if done {
                    state.done = true;
                    state.trailer = trailer;
                }
                if via != TransportKind::Tcp {
                    state.frames += 1;
                }
                Ok(())
            }
            Frame::Error { id, code, message } => {
                Err(TransferError::Remote { peer: self.remote.peer, id, code, message })
            }
            other => Err(TransferError::Protocol(format!("unexpected {}", other.name()))),
        }
    }
}

/// The TRANSFER frame of pull `id`.
fn pull_frame(id: TransferId, remote: &[BlockId], local: &[BlockId]) -> Frame {
    Frame::Transfer { id, mode: TransferMode::Pull, remote: ids(remote), local: ids(local), generation: 0 }
}

fn ids(blocks: &[BlockId]) -> Vec<u32> {
    blocks.iter().map(|b| b.0).collect()
}

/// Opens the transport `kind` to the server at `addr`, whose facts are `remote`.
fn open_transport(
    kind: TransportKind,
    addr: SocketAddr,
    config: &ClientConfig,
    local: &Region,
    remote: &EndpointInfo,
) -> Result<Box<dyn Transport>> {
    Ok(match kind {
        TransportKind::Device => {
            let (Some(ours), Some(theirs)) = (&config.device, &remote.reach.device) else {
                return Err(TransferError::Unavailable("no device arena on one side"));
            };
            Box::new(DeviceTransport::new(ours.open(theirs, &remote.descriptor)?, theirs.pid))
        }
        TransportKind::Shm => {
            let h = remote.reach.shm.ok_or(TransferError::Unavailable("the peer offers no shared memory"))?;
            let src = Region::open(&h, remote.descriptor.clone(), Access::ReadOnly)
                .map_err(TransferError::io("mapping the peer's region"))?;
            Box::new(ShmTransport::new(src, h.pid))
        }
        TransportKind::Tcp => {
            // Data connections offer nothing: pushes go over the control connection.
            let bare = Reach { host: Some(HostId::this()), ..Reach::default() };
            let conns = (0..config.connections.max(1))
                .map(|_| dial(addr, config, local, &bare).map(|(c, _)| c))
                .collect::<Result<Vec<_>>>()?;
            Box::new(TcpTransport::new(remote.peer, conns, config.tcp))
        }
    })
}

/// Opens one authenticated connection, saying `reach` of this side; returns it and the
/// server's facts.
fn dial(addr: SocketAddr, config: &ClientConfig, local: &Region, reach: &Reach) -> Result<(Conn, EndpointInfo)> {
    let stream = TcpStream::connect_timeout(&addr, config.io_timeout).map_err(TransferError::io("connecting"))?;
    let mut conn = Conn::new(stream, config.io_timeout)?;
    // First, before TLS: the member ticket, which earns the handshake a member's slot.
    let unix_ms =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    conn.send_raw(&auth::ticket(&config.secret, unix_ms, &auth::nonce()))?;
    if let Some(tls) = &config.tls {
        let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
        conn.start_tls_client(Arc::clone(tls), name, Instant::now() + config.io_timeout)?;
    }
    let info = EndpointInfo {
        peer: config.peer,
        compat: config.compat.clone(),
        compat_hash: config.compat.hash(),
        descriptor: local.descriptor().clone(),
        region_len: local.len() as u64,
        reach: reach.clone(),
    };
    let client_nonce = auth::nonce();
    conn.send(&Frame::Connect { info, nonce: client_nonce })?;
    let refused = |code, message| TransferError::Remote { peer: PeerId(0), id: TransferId(0), code, message };
    let server_nonce = match conn.recv()? {
        Frame::Challenge { nonce, proof } => {
            let want = auth::proof(&config.secret, Side::Server, &client_nonce, &nonce);
            if !auth::proofs_equal(&proof, &want) {
                return Err(TransferError::AuthFailed("the server does not know the cluster secret"));
            }
            nonce
        }
        Frame::Error { code: crate::ErrorCode::Incompatible, message, .. } => {
            return Err(TransferError::Incompatible(message));
        }
        Frame::Error { code, message, .. } => return Err(refused(code, message)),
        other => return Err(TransferError::Protocol(format!("expected CHALLENGE, got {}", other.name()))),
    };
    let proof = auth::proof(&config.secret, Side::Client, &client_nonce, &server_nonce);
    conn.send(&Frame::Auth { proof })?;
    let remote = match conn.recv()? {
        Frame::Accept { info } => info,
        // (A server tells how a peer does not fit only once it has proved it is a member.)
        Frame::Error { code: crate::ErrorCode::Incompatible, message, .. } => {
            return Err(TransferError::Incompatible(message));
        }
        Frame::Error { code, message, .. } => return Err(refused(code, message)),
        other => return Err(TransferError::Protocol(format!("expected ACCEPT, got {}", other.name()))),
    };
    check_peer(&config.compat, &remote).map_err(TransferError::Incompatible)?;
    Ok((conn, remote))
}
