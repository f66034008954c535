//! One blocking TCP connection: frames in and out, payloads straight between the socket and a
//! region (vectored writes from the arena, reads into the destination blocks). Every call is
//! bounded by the socket timeouts set at construction. Over TLS ([`Conn::start_tls_client`],
//! [`Conn::start_tls_server`]) the same calls go through the connection's [`Session`].

use std::io::{IoSlice, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use baton_kv::ByteRange;

use crate::frame::{Frame, HEADER_LEN, Header, range_sums};
use crate::region::Region;
use crate::tls::Session;
use crate::{Result, TransferError};

/// Most slices handed to one `writev` (Linux's IOV_MAX).
const IOV_MAX: usize = 1024;

/// A framed connection.
#[derive(Debug)]
pub(crate) struct Conn {
    stream: TcpStream,
    timeout: Duration,
    /// The TLS session, once one is started; every handle on the connection shares it.
    tls: Option<Session>,
}

/// The connection's byte stream: the socket, or the TLS session over it.
struct Wire<'a> {
    sock: &'a TcpStream,
    tls: Option<&'a Session>,
}

impl Read for Wire<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self.tls {
            Some(t) => t.read(self.sock, buf),
            None => (&mut &*self.sock).read(buf),
        }
    }
}

impl Write for Wire<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        match self.tls {
            Some(t) => t.write_vectored(self.sock, bufs),
            None => (&mut &*self.sock).write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What of `flags` (and HUP/ERR) descriptor `fd` reports within `wait` (empty: nothing yet);
/// `None` when the poll itself failed. A zero `wait` asks without waiting.
pub(crate) fn poll_one(
    fd: impl std::os::fd::AsFd,
    flags: rustix::event::PollFlags,
    wait: Duration,
) -> Option<rustix::event::PollFlags> {
    use rustix::event::{PollFd, Timespec, poll};
    let wait = Timespec { tv_sec: wait.as_secs() as i64, tv_nsec: i64::from(wait.subsec_nanos()) };
    let mut fds = [PollFd::new(&fd, flags)];
    poll(&mut fds, Some(&wait)).ok().map(|_| fds[0].revents())
}

impl Conn {
    /// Wraps `stream`, bounding every read and write by `timeout`.
    pub(crate) fn new(stream: TcpStream, timeout: Duration) -> Result<Self> {
        stream.set_nodelay(true).map_err(TransferError::io("configuring a socket"))?;
        stream.set_read_timeout(Some(timeout)).map_err(TransferError::io("configuring a socket"))?;
        stream.set_write_timeout(Some(timeout)).map_err(TransferError::io("configuring a socket"))?;
        Ok(Self { stream, timeout, tls: None })
    }

    /// Runs the client's side of a TLS handshake with `name` (checking its certificate), done by
    /// `deadline`; from then on every frame travels inside TLS.
    pub(crate) fn start_tls_client(
        &mut self,
        config: std::sync::Arc<rustls::ClientConfig>,
        name: rustls::pki_types::ServerName<'static>,
        deadline: std::time::Instant,
    ) -> Result<()> {
        let session = Session::client(config, name, &self.stream, deadline).map_err(TransferError::tls)?;
        self.tls_started(session)
    }

    /// Runs the server's side of a TLS handshake, done by `deadline`.
    pub(crate) fn start_tls_server(
        &mut self,
        config: std::sync::Arc<rustls::ServerConfig>,
        deadline: std::time::Instant,
    ) -> Result<()> {
        let session = Session::server(config, &self.stream, deadline).map_err(TransferError::tls)?;
        self.tls_started(session)
    }

    fn tls_started(&mut self, session: Session) -> Result<()> {
        self.tls = Some(session);
        let e = self.err("configuring a socket");
        self.stream.set_read_timeout(Some(self.timeout)).map_err(e)
    }

    /// Whether the peer has closed its end (or the connection broke), asked without waiting:
    /// what an idle connection's owner checks before relying on it.
    pub(crate) fn peer_closed(&self) -> bool {
        use rustix::event::PollFlags;
        poll_one(&self.stream, PollFlags::RDHUP, std::time::Duration::ZERO)
            .is_some_and(|r| r.intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR))
    }

    fn wire(&self) -> Wire<'_> {
        Wire { sock: &self.stream, tls: self.tls.as_ref() }
    }

    /// A second handle on the same socket (a writer for another thread).
    pub(crate) fn try_clone(&self) -> Result<Self> {
        let stream = self.stream.try_clone().map_err(TransferError::io("cloning a socket"))?;
        Ok(Self { stream, timeout: self.timeout, tls: self.tls.clone() })
    }

    /// Shuts the socket down both ways (wakes a thread blocked on it).
    pub(crate) fn shutdown(&self) {
        // Already closed is fine.
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }

    /// Closes this side for writing and reads (discarding) until the peer closes too, for at
    /// most `wait`; `true` when it did (end of stream or reset), i.e. every handle the peer had
    /// on the connection is gone.
    pub(crate) fn close(&mut self, wait: Duration) -> bool {
        if let Some(t) = &self.tls {
            t.close_notify(&self.stream);
        }
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
        let deadline = std::time::Instant::now() + wait;
        let mut scratch = vec![0u8; 64 * 1024];
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() || self.stream.set_read_timeout(Some(left)).is_err() {
                return false;
            }
            match self.stream.read(&mut scratch) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset};
                    return matches!(e.kind(), ConnectionReset | ConnectionAborted | BrokenPipe);
                }
            }
        }
    }

    fn err(&self, context: &'static str) -> impl FnOnce(std::io::Error) -> TransferError + use<> {
        let millis = self.timeout.as_millis() as u64;
        move |e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => TransferError::Timeout { context, millis },
            _ => TransferError::io(context)(e),
        }
    }

    /// Waits up to `poll` for the next frame to start arriving; `false` on timeout. The frame
    /// itself is then read under the full timeout, so a slow peer cannot desynchronise us.
    /// A zero `poll` only looks.
    pub(crate) fn readable(&mut self, poll: Duration) -> Result<bool> {
        if let Some(t) = &self.tls {
            // A frame may already be decrypted, from bytes read with an earlier one.
            if t.buffered().map_err(TransferError::io("waiting for a frame"))? > 0 {
                return Ok(true);
            }
        }
        let mut b = [0u8; 1];
        let r = if poll.is_zero() {
            let e = self.err("configuring a socket");
            self.stream.set_nonblocking(true).map_err(e)?;
            let r = self.stream.peek(&mut b);
            let e = self.err("configuring a socket");
            self.stream.set_nonblocking(false).map_err(e)?;
            r
        } else {
            let e = self.err("configuring a socket");
            self.stream.set_read_timeout(Some(poll)).map_err(e)?;
            let r = self.stream.peek(&mut b);
            let e = self.err("configuring a socket");
            self.stream.set_read_timeout(Some(self.timeout)).map_err(e)?;
            r
        };
        match r {
            Ok(0) => Err(TransferError::PeerClosed("waiting for a frame")),
            Ok(_) => Ok(true),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => Ok(false),
            Err(e) => Err(TransferError::io("waiting for a frame")(e)),
        }
    }

    /// Sends bytes that are no frame: the member ticket a client opens a connection with.
    pub(crate) fn send_raw(&mut self, bytes: &[u8]) -> Result<()> {
        let e = self.err("sending the member ticket");
        self.wire().write_all(bytes).map_err(e)
    }

    /// Sends a frame without payload.
    pub(crate) fn send(&mut self, frame: &Frame) -> Result<()> {
        let bytes = frame.encode();
        let e = self.err("sending a frame");
        self.wire().write_all(&bytes).map_err(e)
    }

    /// Sends the frame `frame` makes of the CRC-32C of each of `ranges` of `region` (a DATA's or
    /// WRITE's `sums`, [`range_sums`]), followed by those bytes, in order, vectored.
    pub(crate) fn send_checked(
        &mut self,
        frame: impl FnOnce(Vec<u32>) -> Frame,
        region: &Region,
        ranges: &[ByteRange],
    ) -> Result<()> {
        let e = self.err("sending KV bytes");
        let mut wire = self.wire();
        region
            .with_many(ranges, |slices| -> std::io::Result<()> {
                let head = frame(range_sums(slices)).encode();
                let mut all: Vec<IoSlice<'_>> = Vec::with_capacity(slices.len() + 1);
                all.push(IoSlice::new(&head));
                all.extend(slices.iter().map(|s| IoSlice::new(s)));
                write_all_vectored(&mut wire, &mut all)
            })?
            .map_err(e)
    }

    /// Sends a frame followed by `payload`.
    pub(crate) fn send_with_bytes(&mut self, frame: &Frame, payload: &[u8]) -> Result<()> {
        let head = frame.encode();
        let e = self.err("sending KV bytes");
        let mut all = [IoSlice::new(&head), IoSlice::new(payload)];
        write_all_vectored(&mut self.wire(), &mut all).map_err(e)
    }

    /// Receives the next frame (its payload, if any, is still on the socket).
    pub(crate) fn recv(&mut self) -> Result<Frame> {
        let mut h = [0u8; HEADER_LEN];
        let e = self.err("waiting for a frame");
        self.wire().read_exact(&mut h).map_err(e)?;
        let header = Header::decode(&h)?;
        let mut meta = vec![0u8; header.meta_len];
        let e = self.err("reading a frame");
        self.wire().read_exact(&mut meta).map_err(e)?;
        Ok(Frame::decode(&header, &meta)?)
    }

    /// Receives a handshake frame from a peer not yet authenticated: the whole frame must
    /// arrive by `deadline` (a per-read timeout alone lets a peer trickling a byte at a time hold
    /// the connection forever), and its metadata may be at most `max_meta` bytes, checked before
    /// anything is allocated for it.
    pub(crate) fn recv_handshake(&mut self, deadline: std::time::Instant, max_meta: usize) -> Result<Frame> {
        let mut h = [0u8; HEADER_LEN];
        self.read_before(&mut h, deadline)?;
        let header = Header::decode(&h)?;
        if header.meta_len > max_meta {
            return Err(TransferError::Protocol(format!(
                "a handshake frame of {} bytes of metadata (at most {max_meta} before authentication)",
                header.meta_len
            )));
        }
        let mut meta = vec![0u8; header.meta_len];
        self.read_before(&mut meta, deadline)?;
        let e = self.err("configuring a socket");
        self.stream.set_read_timeout(Some(self.timeout)).map_err(e)?;
        Ok(Frame::decode(&header, &meta)?)
    }

    /// Fills `buf` from the socket, giving up at `deadline` however the bytes trickle in.
    fn read_before(&mut self, buf: &mut [u8], deadline: std::time::Instant) -> Result<()> {
        let mut filled = 0;
        while filled < buf.len() {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(TransferError::Protocol("the handshake did not arrive in time".into()));
            }
            let e = self.err("configuring a socket");
            self.stream.set_read_timeout(Some(left)).map_err(e)?;
            match self.wire().read(&mut buf[filled..]) {
                Ok(0) => return Err(TransferError::PeerClosed("waiting for the handshake")),
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.err("waiting for the handshake")(e)),
            }
        }
        Ok(())
    }

    /// Reads a payload straight into `ranges` of `region`, in order. The caller holds the
    /// ranges exclusively: they are blocks reserved for the transfer it serves.
    #[allow(unsafe_code)]
    pub(crate) fn recv_into(&mut self, region: &Region, ranges: &[ByteRange]) -> Result<()> {
        for &r in ranges {
            let e = self.err("receiving KV bytes");
            let mut wire = self.wire();
            // SAFETY: the ranges are the destination blocks of the one transfer this connection's
            // thread serves; nothing else in this process reads or writes them meanwhile.
            unsafe { region.with_bytes_mut(r, |b| wire.read_exact(b)) }?.map_err(e)?;
        }
        Ok(())
    }

    /// Reads a payload of `len` bytes and drops it (a refused WRITE's bytes).
    pub(crate) fn skip(&mut self, len: u64) -> Result<()> {
        let e = self.err("skipping KV bytes");
        let copied = std::io::copy(&mut self.wire().take(len), &mut std::io::sink()).map_err(e)?;
        if copied == len {
            Ok(())
        } else {
            Err(TransferError::Protocol(format!("the connection closed {} bytes into a {len}-byte payload", copied)))
        }
    }

    /// Reads a payload of `len` bytes into `buf` (resized to `len`; its allocation is reused).
    pub(crate) fn recv_buf(&mut self, len: usize, buf: &mut Vec<u8>) -> Result<()> {
        buf.resize(len, 0);
        let e = self.err("receiving KV bytes");
        self.wire().read_exact(buf).map_err(e)
    }

    /// Reads a payload of `len` bytes into a new buffer.
    pub(crate) fn recv_vec(&mut self, len: u64) -> Result<Vec<u8>> {
        let len = usize::try_from(len).map_err(|_| TransferError::Protocol("payload too large".into()))?;
        let mut buf = vec![0u8; len];
        let e = self.err("receiving KV bytes");
        self.wire().read_exact(&mut buf).map_err(e)?;
        Ok(buf)
    }
}

/// Checks `ranges` of `region`, just received, against the sums their sender computed: how many
/// distinct blocks of the region hold a range that fails (0: every range arrived intact).
pub(crate) fn damaged_blocks(region: &Region, ranges: &[ByteRange], sums: &[u32]) -> Result<usize> {
    if sums.len() != ranges.len() {
        return Err(TransferError::Protocol(format!("{} checksums for {} ranges", sums.len(), ranges.len())));
    }
    let mut damaged = std::collections::BTreeSet::new();
    for (&r, &sum) in ranges.iter().zip(sums) {
        if r.len > 0 && region.with_bytes(r, crc32c::crc32c)? != sum {
            damaged.extend(blocks_of(region.descriptor(), r));
        }
    }
    Ok(damaged.len())
}

/// The blocks a byte range of a region with descriptor `d` touches: a range lies within one
/// run of consecutive blocks of one (layer, K/V) in every layout, whose block index is the
/// element offset over the block stride, modulo the blocks.
fn blocks_of(d: &baton_kv::TensorDescriptor, r: ByteRange) -> std::ops::RangeInclusive<usize> {
    use baton_kv::Dim;
    let (stride, n) = (d.stride(Dim::Block).max(1) * d.elem_size.max(1), d.extent(Dim::Block).max(1));
    let base = d.base * d.elem_size;
    let block = |byte: usize| (byte.saturating_sub(base) / stride) % n;
    let (first, last) = (block(r.offset), block(r.end().saturating_sub(1)));
    if last >= first { first..=last } else { first..=first }
}

/// `write_all` for vectored writes.
fn write_all_vectored(stream: &mut impl Write, mut bufs: &mut [IoSlice<'_>]) -> std::io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        let n = bufs.len().min(IOV_MAX);
        match stream.write_vectored(&bufs[..n]) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(written) => IoSlice::advance_slices(&mut bufs, written),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
