//! The wire format, with no I/O: frames to bytes and back (mini-redis style).
//!
//! Every frame is a 24-byte header, a metadata body, and (DATA and WRITE only) a raw payload of
//! KV bytes that the connection moves straight between the socket and the arena:
//!
//! ```text
//! magic u32 "BTKV" | version u16 | kind u8 | flags u8 | meta_len u32 | reserved u32 | payload_len u64
//! meta (meta_len bytes) | payload (payload_len bytes)
//! ```
//!
//! All integers are little-endian, written with `to_le_bytes`. A frame with another magic or
//! version is an error, never garbage; so is a body that does not decode exactly.
//!
//! DATA and WRITE carry a CRC-32C of each range of their payload (the sender's
//! [`range_sums`]): the receiver checks every range once it is in place, and a range that fails
//! fails the transfer ([`TransferError::Corrupt`](crate::TransferError::Corrupt)), so bytes
//! damaged on the wire (TCP's own 16-bit checksum misses some; a middlebox may rewrite them)
//! are recomputed, never used. Over TLS the record layer's MAC checks them too.
//!
//! Also here, as the handshake frames' own: the [`ErrorCode`]s an ERROR frame carries, and
//! `check_peer`, whether the facts a peer sent at CONNECT or ACCEPT fit ours.

use baton_kv::{ByteRange, Dim, TensorDescriptor};

use crate::auth::{NONCE_LEN, PROOF_LEN};
use crate::compat::{Compat, dtype_code, dtype_from_code};
use crate::location::{DeviceHandle, DeviceHandleKind, HostId, Location, MAX_DEVICE_HANDLE, Reach, ShmHandle};
use crate::{PeerId, TransferId, TransportKind};

/// First four bytes of every frame: "BTKV".
pub const MAGIC: u32 = u32::from_le_bytes(*b"BTKV");
/// Protocol version this build speaks (3: PUSHED carries a trailer; 4: CONNECT and ACCEPT say
/// where the sender's KV lives, [`Reach`], and PUSHED how the layers were written; 5: a device
/// handle names the process that exported it; 6: device handles shared as descriptors, the
/// stand-in's and CUDA VMM's; 7: DATA and WRITE carry a CRC-32C of each range).
pub const VERSION: u16 = 7;
/// Bytes of a frame header.
pub const HEADER_LEN: usize = 24;
/// Largest metadata body accepted (range lists of a big READ fit easily).
pub const MAX_META: usize = 16 << 20;
/// READ flag: the server gathers the ranges into one buffer first (the naive baseline).
pub const FLAG_GATHER: u8 = 1;

/// CRC-32C of each of `slices` (the bytes of a DATA's or WRITE's ranges, in order): what the
/// frame's `sums` carry.
pub fn range_sums(slices: &[&[u8]]) -> Vec<u32> {
    slices.iter().map(|s| crc32c::crc32c(s)).collect()
}

/// Decoding failures.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Not a frame of this protocol.
    #[error("bad magic {0:#010x} (not a Baton KV transfer peer)")]
    BadMagic(u32),
    /// Another protocol version.
    #[error("protocol version {theirs} is not ours ({ours})")]
    Version {
        /// Ours.
        ours: u16,
        /// Theirs.
        theirs: u16,
    },
    /// Unknown frame kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Body shorter than its fields, or longer.
    #[error("malformed {kind} frame: {detail}")]
    Malformed {
        /// Frame kind.
        kind: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// Metadata larger than [`MAX_META`].
    #[error("frame metadata of {0} bytes exceeds the limit")]
    TooLarge(usize),
}

/// How a transfer moves data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransferMode {
    /// Decode allocates, then reads (KVDirect's default).
    Pull,
    /// Decode reserves blocks and sends their ids; prefill writes into them.
    Push,
}

/// What each side tells the other at CONNECT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointInfo {
    /// Who is talking.
    pub peer: PeerId,
    /// Model, geometry, dtype, block size, layout version.
    pub compat: Compat,
    /// Hash of `compat` as the sender computed it.
    pub compat_hash: u64,
    /// Layout of the sender's KV region.
    pub descriptor: TensorDescriptor,
    /// Bytes of the sender's region.
    pub region_len: u64,
    /// Where the sender's KV lives and how a peer on its host may reach it (its shared-memory
    /// and device handles, when it offers them).
    pub reach: Reach,
}

/// Checks a peer's CONNECT/ACCEPT facts against ours: fields, hash and descriptor.
pub(crate) fn check_peer(ours: &Compat, theirs: &EndpointInfo) -> Result<(), String> {
    if let Some(m) = ours.mismatch(&theirs.compat) {
        return Err(m);
    }
    if theirs.compat_hash != ours.hash() {
        return Err(format!("compatibility hash {:#x} vs ours {:#x}", theirs.compat_hash, ours.hash()));
    }
    ours.check_descriptor(&theirs.descriptor)?;
    let span = theirs.descriptor.base as u64 + theirs.descriptor.num_bytes() as u64;
    if theirs.region_len < span {
        return Err(format!("region of {} bytes is shorter than its descriptor ({span})", theirs.region_len));
    }
    Ok(())
}

/// Codes carried by ERROR frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// Malformed or unexpected frame.
    Protocol,
    /// Compatibility hash or geometry mismatch.
    Incompatible,
    /// Bad or missing proof of the cluster secret.
    AuthFailed,
    /// No lease with that transfer id (never offered, or already completed).
    UnknownTransfer,
    /// The lease ran out and the blocks were released: the data is gone.
    LeaseExpired,
    /// A read outside the blocks the lease covers.
    OutOfBounds,
    /// Anything else on the serving side.
    Internal,
}

impl ErrorCode {
    /// Wire value.
    pub fn to_u16(self) -> u16 {
        match self {
            ErrorCode::Protocol => 1,
            ErrorCode::Incompatible => 2,
            ErrorCode::AuthFailed => 3,
            ErrorCode::UnknownTransfer => 4,
            ErrorCode::LeaseExpired => 5,
            ErrorCode::OutOfBounds => 6,
            ErrorCode::Internal => 7,
        }
    }

    /// From the wire value; unknown values read as [`ErrorCode::Internal`].
    pub fn from_u16(v: u16) -> Self {
        match v {
            1 => ErrorCode::Protocol,
            2 => ErrorCode::Incompatible,
            3 => ErrorCode::AuthFailed,
            4 => ErrorCode::UnknownTransfer,
            5 => ErrorCode::LeaseExpired,
            6 => ErrorCode::OutOfBounds,
            _ => ErrorCode::Internal,
        }
    }
}

/// One protocol message. DATA and WRITE are followed on the wire by `payload_len` raw bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Client → server: who I am, my KV layout, my nonce.
    Connect {
        /// The client's side.
        info: EndpointInfo,
        /// Client nonce.
        nonce: [u8; NONCE_LEN],
    },
    /// Server → client: the server's nonce and its proof of the secret.
    Challenge {
        /// Server nonce.
        nonce: [u8; NONCE_LEN],
        /// HMAC proof of the server.
        proof: [u8; PROOF_LEN],
    },
    /// Client → server: the client's proof of the secret.
    Auth {
        /// HMAC proof of the client.
        proof: [u8; PROOF_LEN],
    },
    /// Server → client: accepted; the server's side.
    Accept {
        /// The server's side.
        info: EndpointInfo,
    },
    /// Client → server: open a transfer (remote = server blocks, local = client blocks).
    Transfer {
        /// The request being transferred.
        id: TransferId,
        /// Pull or push.
        mode: TransferMode,
        /// The server's blocks (pull; empty in push, where the server knows them).
        remote: Vec<u32>,
        /// The client's blocks.
        local: Vec<u32>,
        /// Push: the client's reservation of `local` (a number it never reuses); every WRITE
        /// and PUSHED of this push names it, so a late frame of an earlier push into the same
        /// blocks is told apart and refused. 0 in pull mode.
        generation: u64,
    },
    /// Server → client: the transfer is open.
    TransferOk {
        /// The transfer.
        id: TransferId,
    },
    /// Client → server: send these byte ranges of your region.
    Read {
        /// The transfer the ranges belong to (its lease must be live).
        id: TransferId,
        /// Sequence number echoed in the DATA answer.
        seq: u64,
        /// Byte ranges, answered in this order.
        ranges: Vec<ByteRange>,
        /// [`FLAG_GATHER`] or zero.
        flags: u8,
    },
    /// Server → client: the bytes of one READ, concatenated; `payload_len` bytes follow.
    Data {
        /// The transfer.
        id: TransferId,
        /// The READ's sequence number.
        seq: u64,
        /// Bytes that follow.
        payload_len: u64,
        /// CRC-32C of each of the READ's ranges, in order.
        sums: Vec<u32>,
    },
    /// Server → client (push over TCP): write the payload into these ranges of your region.
    Write {
        /// The transfer.
        id: TransferId,
        /// The reservation written into (the push's TRANSFER named it).
        generation: u64,
        /// Destination byte ranges, filled in order from the payload.
        ranges: Vec<ByteRange>,
        /// Bytes that follow.
        payload_len: u64,
        /// CRC-32C of each range's bytes, in order.
        sums: Vec<u32>,
    },
    /// Server → client (push): layers `..layers_done` are in place; `done` when all are.
    Pushed {
        /// The transfer.
        id: TransferId,
        /// The reservation written into.
        generation: u64,
        /// Layers written so far.
        layers_done: u32,
        /// Whether the push is finished.
        done: bool,
        /// A few numbers the pusher hands the receiver with the data (Baton: with the last
        /// PUSHED of a layer-wise push, the token the prefill sampled, which did not exist when
        /// the decode side registered); empty otherwise.
        trailer: Vec<u32>,
        /// How the layers were written: device to device, into the mapped region, or in WRITE
        /// frames (the receiver's engine must know which copy of its blocks is the newer).
        via: TransportKind,
    },
    /// Client → server: all data of the transfer is read; release the blocks.
    Complete {
        /// The transfer.
        id: TransferId,
    },
    /// Server → client: released; the data read is valid (the lease held throughout).
    CompleteAck {
        /// The transfer.
        id: TransferId,
    },
    /// Either way: a refusal.
    Error {
        /// The transfer (0: the connection).
        id: TransferId,
        /// What kind.
        code: ErrorCode,
        /// Human-readable detail.
        message: String,
    },
}

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Frame kind.
    pub kind: u8,
    /// Flags.
    pub flags: u8,
    /// Bytes of metadata.
    pub meta_len: usize,
    /// Bytes of payload after the metadata.
    pub payload_len: u64,
}

impl Header {
    /// Decodes and checks a header (magic, version, sizes).
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, FrameError> {
        let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(FrameError::Version { ours: VERSION, theirs: version });
        }
        let meta_len = u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize;
        if meta_len > MAX_META {
            return Err(FrameError::TooLarge(meta_len));
        }
        let mut p = [0u8; 8];
        p.copy_from_slice(&b[16..24]);
        Ok(Header { kind: b[6], flags: b[7], meta_len, payload_len: u64::from_le_bytes(p) })
    }
}

mod kind {
    pub(super) const CONNECT: u8 = 1;
    pub(super) const CHALLENGE: u8 = 2;
    pub(super) const AUTH: u8 = 3;
    pub(super) const ACCEPT: u8 = 4;
    pub(super) const TRANSFER: u8 = 5;
    pub(super) const TRANSFER_OK: u8 = 6;
    pub(super) const READ: u8 = 7;
    pub(super) const DATA: u8 = 8;
    pub(super) const WRITE: u8 = 9;
    pub(super) const PUSHED: u8 = 10;
    pub(super) const COMPLETE: u8 = 11;
    pub(super) const COMPLETE_ACK: u8 = 12;
    pub(super) const ERROR: u8 = 13;
}

impl Frame {
    /// Name of the frame kind, for messages.
    pub fn name(&self) -> &'static str {
        kind_name(self.kind())
    }

    fn kind(&self) -> u8 {
        match self {
            Frame::Connect { .. } => kind::CONNECT,
            Frame::Challenge { .. } => kind::CHALLENGE,
            Frame::Auth { .. } => kind::AUTH,
            Frame::Accept { .. } => kind::ACCEPT,
            Frame::Transfer { .. } => kind::TRANSFER,
            Frame::TransferOk { .. } => kind::TRANSFER_OK,
            Frame::Read { .. } => kind::READ,
            Frame::Data { .. } => kind::DATA,
            Frame::Write { .. } => kind::WRITE,
            Frame::Pushed { .. } => kind::PUSHED,
            Frame::Complete { .. } => kind::COMPLETE,
            Frame::CompleteAck { .. } => kind::COMPLETE_ACK,
            Frame::Error { .. } => kind::ERROR,
        }
    }

    /// Bytes of raw payload that follow this frame on the wire.
    pub fn payload_len(&self) -> u64 {
        match self {
            Frame::Data { payload_len, .. } | Frame::Write { payload_len, .. } => *payload_len,
            _ => 0,
        }
    }

    /// Header and metadata, ready to write (the payload, if any, is written after).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer(Vec::with_capacity(64));
        let mut flags = 0;
        match self {
            Frame::Connect { info, nonce } => {
                w.bytes(nonce);
                w.info(info);
            }
            Frame::Challenge { nonce, proof } => {
                w.bytes(nonce);
                w.bytes(proof);
            }
            Frame::Auth { proof } => w.bytes(proof),
            Frame::Accept { info } => w.info(info),
            Frame::Transfer { id, mode, remote, local, generation } => {
                w.u64(id.0);
                w.u8(match mode {
                    TransferMode::Pull => 0,
                    TransferMode::Push => 1,
                });
                w.ids(remote);
                w.ids(local);
                w.u64(*generation);
            }
            Frame::TransferOk { id } | Frame::Complete { id } | Frame::CompleteAck { id } => w.u64(id.0),
            Frame::Read { id, seq, ranges, flags: f } => {
                flags = *f;
                w.u64(id.0);
                w.u64(*seq);
                w.ranges(ranges);
            }
            Frame::Data { id, seq, sums, .. } => {
                w.u64(id.0);
                w.u64(*seq);
                w.ids(sums);
            }
            Frame::Write { id, generation, ranges, sums, .. } => {
                w.u64(id.0);
                w.u64(*generation);
                w.ranges(ranges);
                w.ids(sums);
            }
            Frame::Pushed { id, generation, layers_done, done, trailer, via } => {
                w.u64(id.0);
                w.u64(*generation);
                w.u32(*layers_done);
                w.u8(u8::from(*done));
                w.ids(trailer);
                w.u8(match via {
                    TransportKind::Device => 0,
                    TransportKind::Shm => 1,
                    TransportKind::Tcp => 2,
                });
            }
            Frame::Error { id, code, message } => {
                w.u64(id.0);
                w.u16(code.to_u16());
                w.str(message);
            }
        }
        let meta = w.0;
        let mut out = Vec::with_capacity(HEADER_LEN + meta.len());
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.push(self.kind());
        out.push(flags);
        out.extend_from_slice(&(meta.len() as u32).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&self.payload_len().to_le_bytes());
        out.extend_from_slice(&meta);
        out
    }

    /// Decodes the metadata of a frame whose header is `header`. The payload is not part of it.
    pub fn decode(header: &Header, meta: &[u8]) -> Result<Frame, FrameError> {
        let name = kind_name(header.kind);
        if name == "unknown" {
            return Err(FrameError::UnknownKind(header.kind));
        }
        let mut r = Reader { buf: meta, pos: 0, kind: name };
        let frame = match header.kind {
            kind::CONNECT => {
                let nonce = r.array()?;
                Frame::Connect { nonce, info: r.info()? }
            }
            kind::CHALLENGE => Frame::Challenge { nonce: r.array()?, proof: r.array()? },
            kind::AUTH => Frame::Auth { proof: r.array()? },
            kind::ACCEPT => Frame::Accept { info: r.info()? },
            kind::TRANSFER => {
                let id = TransferId(r.u64()?);
                let mode = match r.u8()? {
                    0 => TransferMode::Pull,
                    1 => TransferMode::Push,
                    m => return Err(r.bad(format!("mode {m}"))),
                };
                Frame::Transfer { id, mode, remote: r.ids()?, local: r.ids()?, generation: r.u64()? }
            }
            kind::TRANSFER_OK => Frame::TransferOk { id: TransferId(r.u64()?) },
            kind::COMPLETE => Frame::Complete { id: TransferId(r.u64()?) },
            kind::COMPLETE_ACK => Frame::CompleteAck { id: TransferId(r.u64()?) },
            kind::READ => {
                Frame::Read { id: TransferId(r.u64()?), seq: r.u64()?, ranges: r.ranges()?, flags: header.flags }
            }
            kind::DATA => {
                let (id, seq) = (TransferId(r.u64()?), r.u64()?);
                Frame::Data { id, seq, payload_len: header.payload_len, sums: r.ids()? }
            }
            kind::WRITE => {
                let (id, generation, ranges) = (TransferId(r.u64()?), r.u64()?, r.ranges()?);
                Frame::Write { id, generation, ranges, payload_len: header.payload_len, sums: r.ids()? }
            }
            kind::PUSHED => Frame::Pushed {
                id: TransferId(r.u64()?),
                generation: r.u64()?,
                layers_done: r.u32()?,
                done: r.u8()? != 0,
                trailer: r.ids()?,
                via: match r.u8()? {
                    0 => TransportKind::Device,
                    1 => TransportKind::Shm,
                    2 => TransportKind::Tcp,
                    x => return Err(r.bad(format!("push transport {x}"))),
                },
            },
            kind::ERROR => {
                Frame::Error { id: TransferId(r.u64()?), code: ErrorCode::from_u16(r.u16()?), message: r.string()? }
            }
            other => return Err(FrameError::UnknownKind(other)),
        };
        if r.pos != meta.len() {
            return Err(r.bad(format!("{} trailing bytes", meta.len() - r.pos)));
        }
        let payload_ok = matches!(header.kind, kind::DATA | kind::WRITE) || header.payload_len == 0;
        if !payload_ok {
            return Err(r.bad("payload on a frame that carries none".into()));
        }
        if let Frame::Write { ranges, payload_len, sums, .. } = &frame {
            if ranges.iter().map(|r| r.len as u64).sum::<u64>() != *payload_len {
                return Err(r.bad("payload length differs from the ranges' total".into()));
            }
            if sums.len() != ranges.len() {
                return Err(r.bad(format!("{} checksums for {} ranges", sums.len(), ranges.len())));
            }
        }
        Ok(frame)
    }
}

fn kind_name(k: u8) -> &'static str {
    match k {
        kind::CONNECT => "CONNECT",
        kind::CHALLENGE => "CHALLENGE",
        kind::AUTH => "AUTH",
        kind::ACCEPT => "ACCEPT",
        kind::TRANSFER => "TRANSFER",
        kind::TRANSFER_OK => "TRANSFER_OK",
        kind::READ => "READ",
        kind::DATA => "DATA",
        kind::WRITE => "WRITE",
        kind::PUSHED => "PUSHED",
        kind::COMPLETE => "COMPLETE",
        kind::COMPLETE_ACK => "COMPLETE_ACK",
        kind::ERROR => "ERROR",
        _ => "unknown",
    }
}

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn i32(&mut self, v: i32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }
    fn str(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.bytes(s.as_bytes());
    }
    fn ids(&mut self, ids: &[u32]) {
        self.u32(ids.len() as u32);
        for &i in ids {
            self.u32(i);
        }
    }
    fn ranges(&mut self, ranges: &[ByteRange]) {
        self.u32(ranges.len() as u32);
        for r in ranges {
            self.u64(r.offset as u64);
            self.u64(r.len as u64);
        }
    }
    fn info(&mut self, info: &EndpointInfo) {
        self.u64(info.peer.0);
        self.str(&info.compat.model);
        let g = &info.compat.geometry;
        for v in [g.layers, g.kv_heads, g.head_dim, g.block_size] {
            self.u64(v as u64);
        }
        self.u8(dtype_code(g.dtype));
        self.u32(info.compat.layout_version);
        self.u64(info.compat_hash);
        let d = &info.descriptor;
        for dim in d.dims {
            self.u8(dim as u8);
        }
        for v in d.shape.iter().chain(&d.strides) {
            self.u64(*v as u64);
        }
        self.u64(d.elem_size as u64);
        self.u64(d.base as u64);
        self.u64(info.region_len);
        let reach = &info.reach;
        match reach.shm {
            None => self.u8(0),
            Some(h) => {
                self.u8(1);
                self.u32(h.pid);
                self.i32(h.fd);
                self.u64(h.len);
            }
        }
        match reach.host {
            None => self.u8(0),
            Some(HostId(id)) => {
                self.u8(1);
                self.0.extend_from_slice(&id);
            }
        }
        match reach.location {
            Location::Host => self.u8(0),
            Location::Device { ordinal, uuid } => {
                self.u8(1);
                self.u32(ordinal);
                self.0.extend_from_slice(&uuid);
            }
        }
        match &reach.device {
            None => self.u8(0),
            Some(h) => {
                self.u8(h.kind.code());
                self.u64(h.len);
                self.u16(h.bytes.len() as u16);
                self.0.extend_from_slice(&h.bytes);
                self.u32(h.pid);
            }
        }
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    kind: &'static str,
}

impl Reader<'_> {
    fn bad(&self, detail: String) -> FrameError {
        FrameError::Malformed { kind: self.kind, detail }
    }
    fn take(&mut self, n: usize) -> Result<&[u8], FrameError> {
        if self.buf.len() - self.pos < n {
            return Err(self.bad(format!("truncated at byte {} (wanted {n} more)", self.pos)));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], FrameError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, FrameError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, FrameError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn i32(&mut self) -> Result<i32, FrameError> {
        Ok(i32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, FrameError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn usize(&mut self) -> Result<usize, FrameError> {
        let v = self.u64()?;
        usize::try_from(v).map_err(|_| self.bad(format!("{v} does not fit in usize")))
    }
    /// A count of items of `item` bytes each, checked against the bytes left.
    fn count(&mut self, item: usize) -> Result<usize, FrameError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(item) > self.buf.len() - self.pos {
            return Err(self.bad(format!("count {n} exceeds the body")));
        }
        Ok(n)
    }
    fn string(&mut self) -> Result<String, FrameError> {
        let n = self.count(1)?;
        let b = self.take(n)?.to_vec();
        String::from_utf8(b).map_err(|_| self.bad("string is not UTF-8".into()))
    }
    fn ids(&mut self) -> Result<Vec<u32>, FrameError> {
        let n = self.count(4)?;
        (0..n).map(|_| self.u32()).collect()
    }
    fn ranges(&mut self) -> Result<Vec<ByteRange>, FrameError> {
        let n = self.count(16)?;
        (0..n).map(|_| Ok(ByteRange { offset: self.usize()?, len: self.usize()? })).collect()
    }
    fn info(&mut self) -> Result<EndpointInfo, FrameError> {
        let peer = PeerId(self.u64()?);
        let model = self.string()?;
        let (layers, kv_heads, head_dim, block_size) = (self.usize()?, self.usize()?, self.usize()?, self.usize()?);
        let code = self.u8()?;
        let dtype = dtype_from_code(code).ok_or_else(|| self.bad(format!("dtype code {code}")))?;
        let layout_version = self.u32()?;
        let compat_hash = self.u64()?;
        let mut dims = [Dim::Layer; 6];
        let mut seen = [false; 6];
        for d in &mut dims {
            let c = self.u8()?;
            *d = match c {
                0 => Dim::Layer,
                1 => Dim::Kv,
                2 => Dim::Block,
                3 => Dim::Token,
                4 => Dim::Head,
                5 => Dim::HeadDim,
                _ => return Err(self.bad(format!("dimension code {c}"))),
            };
            if std::mem::replace(&mut seen[c as usize], true) {
                return Err(self.bad(format!("dimension {d:?} twice")));
            }
        }
        let mut shape = [0usize; 6];
        let mut strides = [0usize; 6];
        for v in shape.iter_mut().chain(strides.iter_mut()) {
            *v = self.usize()?;
        }
        let descriptor = TensorDescriptor { dims, shape, strides, elem_size: self.usize()?, base: self.usize()? };
        let region_len = self.u64()?;
        let shm = match self.u8()? {
            0 => None,
            1 => Some(ShmHandle { pid: self.u32()?, fd: self.i32()?, len: self.u64()? }),
            x => return Err(self.bad(format!("shm tag {x}"))),
        };
        let host = match self.u8()? {
            0 => None,
            1 => Some(HostId(self.array()?)),
            x => return Err(self.bad(format!("host tag {x}"))),
        };
        let location = match self.u8()? {
            0 => Location::Host,
            1 => Location::Device { ordinal: self.u32()?, uuid: self.array()? },
            x => return Err(self.bad(format!("location tag {x}"))),
        };
        let device = match self.u8()? {
            0 => None,
            code => {
                let kind =
                    DeviceHandleKind::from_code(code).ok_or_else(|| self.bad(format!("device handle kind {code}")))?;
                let len = self.u64()?;
                let n = self.u16()? as usize;
                if n > MAX_DEVICE_HANDLE {
                    return Err(self.bad(format!("device handle of {n} bytes")));
                }
                let bytes = self.take(n)?.to_vec();
                Some(DeviceHandle { kind, bytes, len, pid: self.u32()? })
            }
        };
        let geometry = baton_kv::KvGeometry { layers, kv_heads, head_dim, block_size, dtype };
        Ok(EndpointInfo {
            peer,
            compat: Compat { model, geometry, layout_version },
            compat_hash,
            descriptor,
            region_len,
            reach: Reach { host, location, shm, device },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use baton_kv::{KvDtype, KvGeometry, KvLayout};
    use proptest::prelude::*;

    fn info() -> EndpointInfo {
        let g = KvGeometry { dtype: KvDtype::F16, ..KvGeometry::new(4, 2, 8, 16) };
        let compat = Compat::new("m", g);
        EndpointInfo {
            peer: PeerId(7),
            compat_hash: compat.hash(),
            compat,
            descriptor: TensorDescriptor::new(&g, KvLayout::LayerMajor, 10),
            region_len: 12345,
            reach: Reach {
                host: Some(HostId([4; 16])),
                location: Location::Device { ordinal: 1, uuid: [9; 16] },
                shm: Some(ShmHandle { pid: 42, fd: 5, len: 12345 }),
                device: Some(DeviceHandle {
                    kind: DeviceHandleKind::CudaIpc,
                    bytes: vec![5; 64],
                    len: 12345,
                    pid: 4321,
                }),
            },
        }
    }

    fn round_trip(f: &Frame) -> Frame {
        let bytes = f.encode();
        let mut h = [0u8; HEADER_LEN];
        h.copy_from_slice(&bytes[..HEADER_LEN]);
        let header = Header::decode(&h).expect("header");
        assert_eq!(header.meta_len, bytes.len() - HEADER_LEN);
        Frame::decode(&header, &bytes[HEADER_LEN..]).expect("frame")
    }

    #[test]
    fn every_kind_round_trips() {
        let id = TransferId(99);
        let frames = [
            Frame::Connect { info: info(), nonce: [3; NONCE_LEN] },
            Frame::Challenge { nonce: [1; NONCE_LEN], proof: [2; PROOF_LEN] },
            Frame::Auth { proof: [9; PROOF_LEN] },
            Frame::Accept { info: EndpointInfo { reach: Reach::default(), ..info() } },
            Frame::Transfer { id, mode: TransferMode::Push, remote: vec![], local: vec![4, 5, 6], generation: 9 },
            Frame::TransferOk { id },
            Frame::Read { id, seq: 3, ranges: vec![ByteRange { offset: 10, len: 20 }], flags: FLAG_GATHER },
            Frame::Data { id, seq: 3, payload_len: 20, sums: vec![7, 0xdead_beef] },
            Frame::Write {
                id,
                generation: 9,
                ranges: vec![ByteRange { offset: 1, len: 2 }],
                payload_len: 2,
                sums: vec![0x1234_5678],
            },
            Frame::Pushed {
                id,
                generation: 9,
                layers_done: 2,
                done: false,
                trailer: Vec::new(),
                via: TransportKind::Tcp,
            },
            Frame::Pushed {
                id,
                generation: 9,
                layers_done: 2,
                done: true,
                trailer: vec![7, 1 << 31],
                via: TransportKind::Device,
            },
            Frame::Complete { id },
            Frame::CompleteAck { id },
            Frame::Error { id, code: ErrorCode::LeaseExpired, message: "gone".into() },
        ];
        for f in &frames {
            assert_eq!(&round_trip(f), f);
        }
    }

    #[test]
    fn header_is_explicit_little_endian() {
        let bytes = Frame::Complete { id: TransferId(0x0102) }.encode();
        assert_eq!(&bytes[..4], b"BTKV");
        assert_eq!(&bytes[4..6], &VERSION.to_le_bytes());
        assert_eq!(bytes[6], 11);
        assert_eq!(&bytes[8..12], &[8, 0, 0, 0]);
        assert_eq!(&bytes[HEADER_LEN..HEADER_LEN + 2], &[2, 1]);
    }

    #[test]
    fn wrong_magic_and_version_are_errors() {
        let mut bytes = Frame::Complete { id: TransferId(1) }.encode();
        let mut h = [0u8; HEADER_LEN];
        h.copy_from_slice(&bytes[..HEADER_LEN]);
        h[4] = 1;
        assert_eq!(Header::decode(&h), Err(FrameError::Version { ours: VERSION, theirs: 1 }));
        bytes[0] = b'G';
        h.copy_from_slice(&bytes[..HEADER_LEN]);
        assert!(matches!(Header::decode(&h), Err(FrameError::BadMagic(_))));
    }

    proptest! {
        /// Any byte string either decodes or is an error; it never panics, and a truncated
        /// valid body is always an error.
        #[test]
        fn garbage_never_panics(kind in 0u8..16, meta in proptest::collection::vec(any::<u8>(), 0..200)) {
            let header = Header { kind, flags: 0, meta_len: meta.len(), payload_len: 0 };
            let _ = Frame::decode(&header, &meta);
        }

        #[test]
        fn truncation_is_an_error(cut in 1usize..60) {
            let bytes = Frame::Connect { info: info(), nonce: [3; NONCE_LEN] }.encode();
            let mut h = [0u8; HEADER_LEN];
            h.copy_from_slice(&bytes[..HEADER_LEN]);
            let header = Header::decode(&h).expect("header");
            let meta = &bytes[HEADER_LEN..];
            prop_assert!(Frame::decode(&header, &meta[..meta.len() - cut]).is_err());
        }
    }
}
