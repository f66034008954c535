//! Transports: how planned copies move from the peer's region into ours.
//!
//! [`Transport::read`] executes a [`TransferPlan`](crate::TransferPlan)'s copies for one transfer. The device
//! transport copies device to device between the two sides' device arenas (a [`DeviceLink`]:
//! CUDA VMM or IPC on one host); the shared-memory transport is one-sided — a `memcpy` per copy out of
//! the peer's region mapped read-only, the prefill side not involved — and the TCP transport
//! sends READ frames of many ranges each and receives the DATA straight into the destination
//! blocks. An RDMA-class transport fits the same trait: one posted one-sided read per copy
//! against the peer's registered region.

use std::collections::VecDeque;

use baton_kv::ByteRange;

use crate::conn::{Conn, damaged_blocks};
use crate::device::DeviceLink;
use crate::frame::Frame;
use crate::plan::RangeCopy;
use crate::region::Region;
use crate::{PeerId, Result, TransferError, TransferId};

/// Which transport a client uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
pub enum TransportKind {
    /// Copy between the two sides' device arenas (both on devices of one host).
    Device,
    /// Map the peer's region (same host only).
    Shm,
    /// READ / DATA frames over TCP.
    #[default]
    Tcp,
}

impl std::str::FromStr for TransportKind {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "device" => Ok(TransportKind::Device),
            "shm" => Ok(TransportKind::Shm),
            "tcp" => Ok(TransportKind::Tcp),
            other => Err(format!("unknown transport `{other}` (expected device, shm or tcp)")),
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransportKind::Device => "device",
            TransportKind::Shm => "shm",
            TransportKind::Tcp => "tcp",
        })
    }
}

/// Moves the bytes of planned copies from a peer's region into a local one.
pub trait Transport: Send {
    /// Which transport this is.
    fn kind(&self) -> TransportKind;

    /// Executes `copies` (source: the peer's region, destination: `dst`) for transfer `id`;
    /// returns the number of transport calls it took (memcpys, READ round trips, posted reads).
    fn read(&mut self, id: TransferId, copies: &[RangeCopy], dst: &Region) -> Result<usize>;

    /// Whether a pull may read before the peer has answered its TRANSFER (see
    /// [`crate::KvClient::pull`]): the reads must not depend on that answer, and touching the
    /// peer's memory must be safe now. No by default.
    fn reads_before_answer(&self) -> bool {
        false
    }

    /// Whether the peer's process is known to have exited (asked without waiting): its
    /// connection is then dead weight, and a mapping's or a device link's hold on the peer's
    /// memory with it. Only the same-host transports watch their peer; no by default.
    fn peer_exited(&self) -> bool {
        false
    }
}

/// Same-host transport: the peer's region, mapped read-only. The mapping holds the peer's
/// memfd whatever becomes of the peer, so it watches the peer's process too, to say when it is
/// gone ([`Transport::peer_exited`]) and the mapping should be let go.
#[derive(Debug)]
pub struct ShmTransport {
    src: Region,
    owner: Option<ProcessWatch>,
}

impl ShmTransport {
    /// Reads from `src` (a mapping of the region of process `owner`; 0: not said).
    pub fn new(src: Region, owner: u32) -> Self {
        Self { src, owner: ProcessWatch::new(owner) }
    }
}

impl Transport for ShmTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn read(&mut self, _id: TransferId, copies: &[RangeCopy], dst: &Region) -> Result<usize> {
        for c in copies {
            dst.copy_from(&self.src, c.src, c.dst)?;
        }
        Ok(copies.len())
    }

    /// A mapped region stays readable whatever becomes of its owner.
    fn reads_before_answer(&self) -> bool {
        true
    }

    fn peer_exited(&self) -> bool {
        self.owner.as_ref().is_some_and(|w| !w.alive())
    }
}

/// Same-host transport between device arenas: the peer's arena opened from its handle, each
/// copy device to device. The destination is this side's device arena, not the host region
/// `read` is handed.
///
/// How far a pull may trust the peer's memory depends on the link. One that holds the memory
/// itself ([`DeviceLink::outlives_exporter`]: CUDA VMM, the stand-in) reads whenever it likes:
/// after the exporter died the bytes are still those its lease vouched for, and the transfer
/// fails at the answers it never gets. A legacy CUDA IPC link does not: a dead exporter's
/// memory is undefined to touch, so it watches the exporting process through a pidfd (the
/// handle names it) and reads before TRANSFER's answer only while the exporter lives; without
/// a pidfd (an exporter that did not say, a kernel without `pidfd_open`), TRANSFER_OK is what
/// says it lives, one round trip more. Either way the watch tells the owner when the exporter
/// is gone ([`Transport::peer_exited`]), so that what the link holds of its arena is let go.
#[derive(Debug)]
pub struct DeviceTransport {
    link: Box<dyn DeviceLink>,
    exporter: Option<ProcessWatch>,
}

impl DeviceTransport {
    /// Copies over `link` (this side's arena and the peer's, opened), watching process
    /// `exporter` (0: not said).
    pub fn new(link: Box<dyn DeviceLink>, exporter: u32) -> Self {
        Self { link, exporter: ProcessWatch::new(exporter) }
    }

    /// Whether the exporter is known to be alive now.
    fn exporter_alive(&self) -> bool {
        self.exporter.as_ref().is_some_and(ProcessWatch::alive)
    }
}

/// A peer process on this host, watched through a pidfd: whether it still lives, asked without
/// waiting. What makes touching its exported device memory safe to attempt (a dead process's
/// CUDA IPC memory is undefined to read or write: the allocation may already serve another).
#[derive(Debug)]
pub(crate) struct ProcessWatch(std::os::fd::OwnedFd);

impl ProcessWatch {
    /// A watch of process `pid` (0: not said); `None` when it cannot be opened (the process is
    /// gone already, or the kernel has no `pidfd_open`).
    pub(crate) fn new(pid: u32) -> Option<Self> {
        let pid = rustix::process::Pid::from_raw(i32::try_from(pid).ok()?)?;
        rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok().map(Self)
    }

    /// Whether the process lives: its pidfd is not readable (it becomes so when the process
    /// exits, zombie or reaped).
    pub(crate) fn alive(&self) -> bool {
        let polled = crate::conn::poll_one(&self.0, rustix::event::PollFlags::IN, std::time::Duration::ZERO);
        polled.is_some_and(|r| r.is_empty())
    }
}

impl Transport for DeviceTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Device
    }

    /// On a link that does not outlive its exporter, refuses, touching nothing, once the
    /// exporter is known to have exited (whichever way the pull was opened: a transfer held
    /// open across a pause may outlive its exporter).
    fn read(&mut self, _id: TransferId, copies: &[RangeCopy], _dst: &Region) -> Result<usize> {
        if !self.link.outlives_exporter() && self.exporter.is_some() && !self.exporter_alive() {
            return Err(TransferError::Unavailable("the process that exported the device arena has exited"));
        }
        self.link.pull(copies)?;
        Ok(copies.len())
    }

    fn reads_before_answer(&self) -> bool {
        self.link.outlives_exporter() || self.exporter_alive()
    }

    fn peer_exited(&self) -> bool {
        self.exporter.as_ref().is_some_and(|w| !w.alive())
    }
}

/// Limits of the TCP transport's READ frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpLimits {
    /// Most ranges in one READ.
    pub max_ranges: usize,
    /// READs in flight per connection.
    pub window: usize,
}

impl Default for TcpLimits {
    fn default() -> Self {
        Self { max_ranges: 4096, window: 2 }
    }
}

/// Cross-host transport: READ frames over one or more TCP connections to the peer's KV server.
#[derive(Debug)]
pub struct TcpTransport {
    peer: PeerId,
    conns: Vec<Conn>,
    limits: TcpLimits,
    seq: u64,
}

impl TcpTransport {
    pub(crate) fn new(peer: PeerId, conns: Vec<Conn>, limits: TcpLimits) -> Self {
        Self { peer, conns, limits, seq: 0 }
    }
}

/// One READ: the copies it covers.
type Batch<'a> = &'a [RangeCopy];

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn read(&mut self, id: TransferId, copies: &[RangeCopy], dst: &Region) -> Result<usize> {
        let max = self.limits.max_ranges.max(1);
        let batches: Vec<Batch<'_>> = if self.conns.len() <= 1 {
            copies.chunks(max).collect()
        } else {
            // Enough batches to spread over the connections, still never splitting a copy.
            let per = copies.len().div_ceil(self.conns.len()).clamp(1, max);
            copies.chunks(per).collect()
        };
        let calls = batches.len();
        let n = self.conns.len().max(1);
        let mut lanes: Vec<Vec<(u64, Batch<'_>)>> = vec![Vec::new(); n];
        for (i, b) in batches.into_iter().enumerate() {
            self.seq += 1;
            lanes[i % n].push((self.seq, b));
        }
        let (peer, window) = (self.peer, self.limits.window.max(1));
        if self.conns.len() == 1 {
            let lane = std::mem::take(&mut lanes[0]);
            read_lane(&mut self.conns[0], peer, id, &lane, dst, window)?;
        } else {
            std::thread::scope(|s| {
                let handles: Vec<_> = self
                    .conns
                    .iter_mut()
                    .zip(lanes)
                    .map(|(conn, lane)| s.spawn(move || read_lane(conn, peer, id, &lane, dst, window)))
                    .collect();
                handles.into_iter().try_for_each(|h| {
                    h.join().map_err(|_| TransferError::Protocol("a TCP reader thread panicked".into()))?
                })
            })?;
        }
        Ok(calls)
    }
}

/// Pipelines the READs of one connection: up to `window` in flight, DATA received in order
/// straight into the destination ranges.
fn read_lane(
    conn: &mut Conn,
    peer: PeerId,
    id: TransferId,
    lane: &[(u64, Batch<'_>)],
    dst: &Region,
    window: usize,
) -> Result<()> {
    let mut in_flight: VecDeque<(u64, Batch<'_>)> = VecDeque::new();
    let mut next = 0;
    while next < lane.len() || !in_flight.is_empty() {
        while next < lane.len() && in_flight.len() < window {
            let (seq, batch) = lane[next];
            let ranges: Vec<ByteRange> = batch.iter().map(|c| c.src).collect();
            conn.send(&Frame::Read { id, seq, ranges, flags: 0 })?;
            in_flight.push_back((seq, batch));
            next += 1;
        }
        let Some((seq, batch)) = in_flight.pop_front() else { break };
        match conn.recv()? {
            Frame::Data { id: got, seq: s, payload_len, sums } if got == id && s == seq => {
                let want: u64 = batch.iter().map(|c| c.dst.len as u64).sum();
                if payload_len != want {
                    return Err(TransferError::Protocol(format!("DATA of {payload_len} bytes for a {want}-byte READ")));
                }
                let ranges: Vec<ByteRange> = batch.iter().map(|c| c.dst).collect();
                conn.recv_into(dst, &ranges)?;
                let blocks = damaged_blocks(dst, &ranges, &sums)?;
                if blocks > 0 {
                    // The connection is still in step: the READs in flight are drained.
                    drain(conn, in_flight.len())?;
                    return Err(TransferError::Corrupt { peer, id, blocks });
                }
            }
            Frame::Error { id, code, message } => {
                drain(conn, in_flight.len())?;
                return Err(TransferError::Remote { peer, id, code, message });
            }
            other => return Err(TransferError::Protocol(format!("expected DATA, got {}", other.name()))),
        }
    }
    Ok(())
}

/// Reads and drops the answers to `n` READs still in flight, so the connection stays usable
/// after a refused read.
fn drain(conn: &mut Conn, n: usize) -> Result<()> {
    for _ in 0..n {
        if let Frame::Data { payload_len, .. } = conn.recv()? {
            conn.recv_vec(payload_len)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A link that copies nothing (the liveness rule is the transport's, not the link's),
    /// holding the peer's memory itself or not.
    #[derive(Debug)]
    struct NoLink {
        outlives_exporter: bool,
    }

    impl DeviceLink for NoLink {
        fn pull(&self, _copies: &[RangeCopy]) -> Result<()> {
            Ok(())
        }
        fn push(&self, _copies: &[RangeCopy]) -> Result<()> {
            Ok(())
        }
        fn outlives_exporter(&self) -> bool {
            self.outlives_exporter
        }
    }

    const IPC: NoLink = NoLink { outlives_exporter: false };
    const VMM: NoLink = NoLink { outlives_exporter: true };

    fn dst() -> Region {
        let g =
            baton_kv::KvGeometry { layers: 1, kv_heads: 1, head_dim: 4, block_size: 2, dtype: baton_kv::KvDtype::F32 };
        Region::create(baton_kv::TensorDescriptor::new(&g, baton_kv::KvLayout::BlockMajor, 2)).expect("region")
    }

    /// A device pull reads before TRANSFER's answer only while the exporting process lives: not
    /// once it has exited (reaped or not), and never for an exporter that did not say who it is;
    /// and a read after the exporter exited is refused.
    #[test]
    fn a_device_link_reads_ahead_only_while_its_exporter_lives() {
        let dst = dst();
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("sleep");
        let mut link = DeviceTransport::new(Box::new(IPC), child.id());
        assert!(link.reads_before_answer(), "the exporter lives");
        assert_eq!(link.read(TransferId(1), &[], &dst).ok(), Some(0));
        child.kill().expect("kill");
        // Exited but not yet reaped (a zombie): already dead to the link, once the kill lands.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while link.reads_before_answer() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!link.reads_before_answer(), "the exporter exited");
        assert!(link.peer_exited());
        assert!(link.read(TransferId(2), &[], &dst).is_err(), "a read from an exporter that exited");
        child.wait().expect("wait");
        assert!(!link.reads_before_answer(), "the exporter was reaped");
        assert!(!DeviceTransport::new(Box::new(IPC), 0).reads_before_answer(), "an exporter that did not say");
        assert!(DeviceTransport::new(Box::new(IPC), std::process::id()).reads_before_answer());
        assert!(ProcessWatch::new(child.id()).is_none(), "a reaped process cannot be watched");
    }

    /// A link that outlives its exporter reads ahead whoever exported it, and goes on reading
    /// after the exporter died (its memory is still the link's); the watch still says the
    /// exporter is gone, so that its owner lets the link go.
    #[test]
    fn a_link_that_outlives_its_exporter_reads_whenever_and_still_says_when_it_is_gone() {
        let dst = dst();
        assert!(DeviceTransport::new(Box::new(VMM), 0).reads_before_answer(), "an exporter that did not say");
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("sleep");
        let mut link = DeviceTransport::new(Box::new(VMM), child.id());
        assert!(link.reads_before_answer() && !link.peer_exited());
        child.kill().expect("kill");
        child.wait().expect("wait");
        assert!(link.peer_exited(), "the exporter was reaped");
        assert!(link.reads_before_answer());
        assert_eq!(link.read(TransferId(1), &[], &dst).ok(), Some(0), "a read after the exporter died");
    }
}
