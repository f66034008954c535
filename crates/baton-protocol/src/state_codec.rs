//! The state stream's binary encoding: a worker's [`StateUpdate`]s as length-prefixed frames,
//! and the bounded readers that turn the bytes of a stream (binary, or NDJSON for `curl`) back
//! into updates. Bytes in, updates out: no sockets here ([`crate::control`] serves the stream,
//! `baton_conductor::remote` reads it).
//!
//! The control API answers `GET /worker/v1/state` in this encoding when the request says
//! `Accept: application/x-baton-state-v1` ([`STATE_MEDIA_TYPE`]), and in NDJSON otherwise. A
//! delta of 1024 prompt blocks takes about 9 bytes a block here, against about 90 in JSON, and
//! decodes several times faster.
//!
//! # Format, version 1
//!
//! Every integer is little-endian; `f64`s are their IEEE-754 bits as a `u64`.
//!
//! ```text
//! frame    := magic:u8 (0xB7) version:u8 (1) len:u32 body[len]      len <= MAX_FRAME_BYTES
//! body     := kind:u8 at_ms:u64 load rest
//!   kind 0 (snapshot): rest := next_seq:u64 n:u32 block*n
//!   kind 1 (delta):    rest := n:u32 event*n
//! load     := running waiting queued_prefill_tokens incoming receiving leased free_blocks
//!             cached_blocks evictable_blocks total_blocks step_time_us decode_step_us (u64 each)
//!             decode_step_batch:f64 decode_step_context:f64 role:u8 n:u32 decode_context:u64*n
//!   role: 0 none, 1 prefill, 2 decode, 3 colocated
//! block    := tag:u8 hash:u64 [parent:u64]
//! event    := tag:u8 [seq:u64] hash:u64 [parent:u64]
//! tag bits 0-1: tier (0 device, 1 host, 2 disk; 0 for a removal)
//!          2-3: parent (0 none, 1 the previous entry's hash, 2 explicit: `parent` follows;
//!               0 unless stored)
//!          4-5: op (events only: 0 stored, 1 moved, 2 removed)
//!          6:   seq follows (events only); otherwise the previous event's seq + 1 (a delta's
//!               first event always carries it)
//!          7:   0
//! ```
//!
//! A block's parent is nearly always the block before it (a prompt's blocks are stored in
//! order), so a typical stored event is 9 bytes: its tag and its hash. Anything else (an
//! unknown version, a reserved bit set, a count the frame cannot hold, bytes left over) is a
//! [`StateCodecError`], never a panic, and a frame longer than [`MAX_FRAME_BYTES`] is refused
//! from its header, before its body is buffered.

use crate::wire::Role;
use crate::wire::{BlockChange, BlockEvent, CachedBlock, KvTier, LoadReport, StateUpdate};

/// The media type of the binary state stream, its version in its name: what the conductor's
/// `Accept` header asks for and what the worker's `Content-Type` then says.
pub const STATE_MEDIA_TYPE: &str = "application/x-baton-state-v1";
/// The media type of the NDJSON state stream (one JSON [`StateUpdate`] a line).
pub const NDJSON_MEDIA_TYPE: &str = "application/x-ndjson";
/// The first byte of every frame.
pub const MAGIC: u8 = 0xB7;
/// The encoding's version, the second byte of every frame.
pub const VERSION: u8 = 1;
/// Bytes of a frame's header: magic, version, body length.
pub const HEADER_BYTES: usize = 6;
/// The longest frame body a reader accepts (and an encoder writes): a snapshot of about 110
/// million blocks, more than any device, host and disk tier hold between them, so a worker's
/// snapshot always fits (a worker whose snapshot did not would be resubscribed to forever). A
/// peer announcing more is refused before anything more is buffered; a reader buffers only what
/// arrives, never what a header announces.
pub const MAX_FRAME_BYTES: usize = 1 << 30;
/// The longest line the NDJSON reader accepts: the same bound (JSON takes about ten times the
/// bytes of the binary frame, so NDJSON, the debugging format, carries snapshots of about 11
/// million blocks).
pub const MAX_LINE_BYTES: usize = MAX_FRAME_BYTES;

const KIND_SNAPSHOT: u8 = 0;
const KIND_DELTA: u8 = 1;
const TIER_MASK: u8 = 0b11;
const PARENT_SHIFT: u8 = 2;
const PARENT_NONE: u8 = 0;
const PARENT_PREVIOUS: u8 = 1;
const PARENT_EXPLICIT: u8 = 2;
const OP_SHIFT: u8 = 4;
const OP_STORED: u8 = 0;
const OP_MOVED: u8 = 1;
const OP_REMOVED: u8 = 2;
const SEQ_FOLLOWS: u8 = 1 << 6;
const RESERVED: u8 = 1 << 7;
/// The fewest bytes a block or an event takes: its tag and its hash.
const MIN_ENTRY_BYTES: usize = 9;

/// Why bytes of a state stream are not an update.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateCodecError {
    /// The frame does not start with [`MAGIC`]: not this encoding, or the stream lost its place.
    #[error("not a state frame (first byte {0:#04x})")]
    BadMagic(u8),
    /// A version this build does not read.
    #[error("state frame version {0}; this build reads version {VERSION}")]
    Version(u8),
    /// A frame (or an update to encode) over the limit.
    #[error("a state frame of {len} bytes is over the limit of {max}")]
    TooLarge {
        /// Its length, or how many bytes it would take.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The frame ends inside a field.
    #[error("the state frame ends inside its {what} (byte {at})")]
    Truncated {
        /// The field.
        what: &'static str,
        /// Where it starts in the body.
        at: usize,
    },
    /// A field holds a value the format does not define.
    #[error("invalid {what} {value:#x} (byte {at})")]
    Invalid {
        /// The field.
        what: &'static str,
        /// Its value.
        value: u64,
        /// Where it starts in the body.
        at: usize,
    },
    /// Bytes after the update, inside its frame.
    #[error("{0} bytes after the state update, inside its frame")]
    Trailing(usize),
    /// An NDJSON line over [`MAX_LINE_BYTES`].
    #[error("an NDJSON state line is over {max} bytes")]
    LineTooLong {
        /// The limit.
        max: usize,
    },
    /// An NDJSON line that is not a [`StateUpdate`].
    #[error("unreadable NDJSON state update: {0}")]
    Json(String),
}

/// How a state stream is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateFormat {
    /// Frames of this module's encoding ([`STATE_MEDIA_TYPE`]).
    Binary,
    /// One JSON update a line ([`NDJSON_MEDIA_TYPE`]).
    Ndjson,
}

impl StateFormat {
    /// The format a response's `Content-Type` names (NDJSON for anything but the binary type:
    /// a worker that predates it answers NDJSON whatever was asked).
    pub fn from_content_type(content_type: Option<&str>) -> Self {
        match content_type {
            Some(ct) if media_type(ct).eq_ignore_ascii_case(STATE_MEDIA_TYPE) => Self::Binary,
            _ => Self::Ndjson,
        }
    }

    /// The format an `Accept` header asks for: binary when it lists [`STATE_MEDIA_TYPE`]
    /// (parameters, `q` included, are not weighed), NDJSON otherwise.
    pub fn from_accept<'a>(accept: impl IntoIterator<Item = &'a str>) -> Self {
        let listed =
            accept.into_iter().flat_map(|v| v.split(',')).any(|m| media_type(m).eq_ignore_ascii_case(STATE_MEDIA_TYPE));
        if listed { Self::Binary } else { Self::Ndjson }
    }

    /// Its media type.
    pub fn media_type(self) -> &'static str {
        match self {
            Self::Binary => STATE_MEDIA_TYPE,
            Self::Ndjson => NDJSON_MEDIA_TYPE,
        }
    }

    /// Appends one update in this format to `out` (a frame, or a line with its newline).
    pub fn encode(self, update: &StateUpdate, out: &mut Vec<u8>) -> Result<(), StateCodecError> {
        match self {
            Self::Binary => encode(update, out),
            Self::Ndjson => {
                serde_json::to_writer(&mut *out, update).map_err(|e| StateCodecError::Json(e.to_string()))?;
                out.push(b'\n');
                Ok(())
            }
        }
    }
}

/// The media type of a header value, without its parameters or spaces.
fn media_type(value: &str) -> &str {
    value.split(';').next().unwrap_or_default().trim()
}

/// Appends `update`'s frame to `out`. Fails only for an update whose frame would be over
/// [`MAX_FRAME_BYTES`] (then `out` is as it was).
pub fn encode(update: &StateUpdate, out: &mut Vec<u8>) -> Result<(), StateCodecError> {
    let entries = match update {
        StateUpdate::Snapshot { blocks, .. } => blocks.len(),
        StateUpdate::Delta { events, .. } => events.len(),
    };
    let contexts = update.load().decode_contexts.len();
    let least = entries.saturating_mul(MIN_ENTRY_BYTES).saturating_add(contexts.saturating_mul(8));
    if least > MAX_FRAME_BYTES {
        return Err(StateCodecError::TooLarge { len: least, max: MAX_FRAME_BYTES });
    }
    let frame_start = out.len();
    out.extend_from_slice(&[MAGIC, VERSION, 0, 0, 0, 0]);
    let body_start = out.len();
    match update {
        StateUpdate::Snapshot { next_seq, blocks, load, at_ms } => {
            out.push(KIND_SNAPSHOT);
            put_u64(out, *at_ms);
            put_load(out, load);
            put_u64(out, *next_seq);
            put_u32(out, blocks.len() as u32);
            out.reserve(blocks.len() * MIN_ENTRY_BYTES);
            let mut previous = None;
            for b in blocks {
                put_entry(out, 0, b.hash, b.tier, b.parent, previous);
                previous = Some(b.hash);
            }
        }
        StateUpdate::Delta { events, load, at_ms } => {
            out.push(KIND_DELTA);
            put_u64(out, *at_ms);
            put_load(out, load);
            put_u32(out, events.len() as u32);
            out.reserve(events.len() * MIN_ENTRY_BYTES);
            let (mut previous, mut previous_seq): (Option<u64>, Option<u64>) = (None, None);
            for e in events {
                let implied = previous_seq.and_then(|s| s.checked_add(1)) == Some(e.seq);
                let seq_bit = if implied { 0 } else { SEQ_FOLLOWS };
                let (op, hash, tier, parent) = match e.change {
                    BlockChange::Stored(b) => (OP_STORED, b.hash, b.tier, b.parent),
                    BlockChange::Moved { hash, tier } => (OP_MOVED, hash, tier, None),
                    BlockChange::Removed { hash } => (OP_REMOVED, hash, KvTier::Device, None),
                };
                let tag = seq_bit | op << OP_SHIFT;
                if implied {
                    put_entry(out, tag, hash, tier, parent, previous);
                } else {
                    put_entry_with_seq(out, tag, e.seq, hash, tier, parent, previous);
                }
                previous = Some(hash);
                previous_seq = Some(e.seq);
            }
        }
    }
    let len = out.len() - body_start;
    if len > MAX_FRAME_BYTES {
        out.truncate(frame_start);
        return Err(StateCodecError::TooLarge { len, max: MAX_FRAME_BYTES });
    }
    out[frame_start + 2..body_start].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(())
}

fn tier_bits(tier: KvTier) -> u8 {
    match tier {
        KvTier::Device => 0,
        KvTier::Host => 1,
        KvTier::Disk => 2,
    }
}

fn parent_bits(parent: Option<u64>, previous: Option<u64>) -> u8 {
    match parent {
        None => PARENT_NONE,
        Some(p) if Some(p) == previous => PARENT_PREVIOUS,
        Some(_) => PARENT_EXPLICIT,
    }
}

#[inline]
fn put_entry(out: &mut Vec<u8>, tag: u8, hash: u64, tier: KvTier, parent: Option<u64>, previous: Option<u64>) {
    let parent_mode = parent_bits(parent, previous);
    out.push(tag | tier_bits(tier) | parent_mode << PARENT_SHIFT);
    put_u64(out, hash);
    if let (PARENT_EXPLICIT, Some(p)) = (parent_mode, parent) {
        put_u64(out, p);
    }
}

#[inline]
fn put_entry_with_seq(
    out: &mut Vec<u8>,
    tag: u8,
    seq: u64,
    hash: u64,
    tier: KvTier,
    parent: Option<u64>,
    previous: Option<u64>,
) {
    let parent_mode = parent_bits(parent, previous);
    out.push(tag | tier_bits(tier) | parent_mode << PARENT_SHIFT);
    put_u64(out, seq);
    put_u64(out, hash);
    if let (PARENT_EXPLICIT, Some(p)) = (parent_mode, parent) {
        put_u64(out, p);
    }
}

fn put_load(out: &mut Vec<u8>, l: &LoadReport) {
    for n in [
        l.running,
        l.waiting,
        l.queued_prefill_tokens,
        l.incoming,
        l.receiving,
        l.leased,
        l.free_blocks,
        l.cached_blocks,
        l.evictable_blocks,
        l.total_blocks,
    ] {
        put_u64(out, n as u64);
    }
    put_u64(out, l.step_time_us);
    put_u64(out, l.decode_step_us);
    put_u64(out, l.decode_step_batch.to_bits());
    put_u64(out, l.decode_step_context.to_bits());
    out.push(match l.role {
        None => 0,
        Some(Role::Prefill) => 1,
        Some(Role::Decode) => 2,
        Some(Role::Colocated) => 3,
    });
    put_u32(out, l.decode_contexts.len() as u32);
    for &c in &l.decode_contexts {
        put_u64(out, c as u64);
    }
}

#[inline]
fn put_u64(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(&n.to_le_bytes());
}

#[inline]
fn put_u32(out: &mut Vec<u8>, n: u32) {
    out.extend_from_slice(&n.to_le_bytes());
}

/// The body length a frame's header announces, once `bytes` holds the header: `Ok(None)`
/// before that; an error for a header that is not this encoding's or announces too much.
pub fn frame_len(bytes: &[u8]) -> Result<Option<usize>, StateCodecError> {
    let Some(header) = bytes.get(..HEADER_BYTES) else {
        // Refuse a wrong first byte at once rather than after six.
        return match bytes.first() {
            Some(&b) if b != MAGIC => Err(StateCodecError::BadMagic(b)),
            _ => Ok(None),
        };
    };
    if header[0] != MAGIC {
        return Err(StateCodecError::BadMagic(header[0]));
    }
    if header[1] != VERSION {
        return Err(StateCodecError::Version(header[1]));
    }
    let len = u32::from_le_bytes([header[2], header[3], header[4], header[5]]) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(StateCodecError::TooLarge { len, max: MAX_FRAME_BYTES });
    }
    Ok(Some(len))
}

/// The update in `frame`, which must be exactly one whole frame.
pub fn decode(frame: &[u8]) -> Result<StateUpdate, StateCodecError> {
    let len = frame_len(frame)?.ok_or(StateCodecError::Truncated { what: "frame header", at: 0 })?;
    let body = &frame[HEADER_BYTES..];
    if body.len() < len {
        return Err(StateCodecError::Truncated { what: "frame body", at: body.len() });
    }
    if body.len() > len {
        return Err(StateCodecError::Trailing(body.len() - len));
    }
    decode_body(body)
}

/// The update a frame's body holds.
fn decode_body(body: &[u8]) -> Result<StateUpdate, StateCodecError> {
    let mut r = Reader { buf: body, at: 0 };
    let kind = r.u8("update kind")?;
    let at_ms = r.u64("time")?;
    let load = r.load()?;
    let update = match kind {
        KIND_SNAPSHOT => {
            let next_seq = r.u64("next sequence number")?;
            let n = r.count("block count", MIN_ENTRY_BYTES)?;
            let mut blocks = Vec::with_capacity(n);
            let mut previous = None;
            for _ in 0..n {
                let at = r.at;
                let tag = r.u8("block tag")?;
                if tag & !(TIER_MASK | 0b11 << PARENT_SHIFT) != 0 {
                    return Err(StateCodecError::Invalid { what: "block tag", value: tag.into(), at });
                }
                let tier = tier_of(tag, at)?;
                let hash = r.u64("block hash")?;
                let parent = r.parent(tag, previous, at)?;
                blocks.push(CachedBlock { hash, parent, tier });
                previous = Some(hash);
            }
            StateUpdate::Snapshot { next_seq, blocks, load, at_ms }
        }
        KIND_DELTA => {
            let n = r.count("event count", MIN_ENTRY_BYTES)?;
            let mut events = Vec::with_capacity(n);
            let (mut previous, mut previous_seq): (Option<u64>, Option<u64>) = (None, None);
            for _ in 0..n {
                let at = r.at;
                let tag = r.u8("event tag")?;
                if tag & RESERVED != 0 {
                    return Err(StateCodecError::Invalid { what: "event tag", value: tag.into(), at });
                }
                let seq = if tag & SEQ_FOLLOWS != 0 {
                    r.u64("sequence number")?
                } else {
                    previous_seq.and_then(|s| s.checked_add(1)).ok_or(StateCodecError::Invalid {
                        what: "event tag (no sequence number to follow)",
                        value: tag.into(),
                        at,
                    })?
                };
                let hash = r.u64("block hash")?;
                let change = match (tag >> OP_SHIFT) & 0b11 {
                    OP_STORED => {
                        let tier = tier_of(tag, at)?;
                        BlockChange::Stored(CachedBlock { hash, parent: r.parent(tag, previous, at)?, tier })
                    }
                    OP_MOVED if tag >> PARENT_SHIFT & 0b11 == PARENT_NONE => {
                        BlockChange::Moved { hash, tier: tier_of(tag, at)? }
                    }
                    OP_REMOVED if tag & (TIER_MASK | 0b11 << PARENT_SHIFT) == 0 => BlockChange::Removed { hash },
                    _ => return Err(StateCodecError::Invalid { what: "event tag", value: tag.into(), at }),
                };
                events.push(BlockEvent { seq, change });
                previous = Some(hash);
                previous_seq = Some(seq);
            }
            StateUpdate::Delta { events, load, at_ms }
        }
        other => return Err(StateCodecError::Invalid { what: "update kind", value: other.into(), at: 0 }),
    };
    match body.len() - r.at {
        0 => Ok(update),
        left => Err(StateCodecError::Trailing(left)),
    }
}

#[inline]
fn tier_of(tag: u8, at: usize) -> Result<KvTier, StateCodecError> {
    match tag & TIER_MASK {
        0 => Ok(KvTier::Device),
        1 => Ok(KvTier::Host),
        2 => Ok(KvTier::Disk),
        _ => Err(StateCodecError::Invalid { what: "tier", value: tag.into(), at }),
    }
}

/// A cursor over a frame's body; every read checks the bytes are there.
struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    #[inline]
    fn take<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], StateCodecError> {
        let bytes = self
            .buf
            .get(self.at..self.at + N)
            .and_then(|b| <[u8; N]>::try_from(b).ok())
            .ok_or(StateCodecError::Truncated { what, at: self.at })?;
        self.at += N;
        Ok(bytes)
    }

    #[inline]
    fn u8(&mut self, what: &'static str) -> Result<u8, StateCodecError> {
        Ok(self.take::<1>(what)?[0])
    }

    #[inline]
    fn u64(&mut self, what: &'static str) -> Result<u64, StateCodecError> {
        self.take(what).map(u64::from_le_bytes)
    }

    fn usize(&mut self, what: &'static str) -> Result<usize, StateCodecError> {
        let at = self.at;
        let n = self.u64(what)?;
        usize::try_from(n).map_err(|_| StateCodecError::Invalid { what, value: n, at })
    }

    /// A count of entries of at least `each` bytes, refused when the rest of the body cannot
    /// hold them (so a hostile count never sizes an allocation).
    fn count(&mut self, what: &'static str, each: usize) -> Result<usize, StateCodecError> {
        let at = self.at;
        let n = u32::from_le_bytes(self.take(what)?) as usize;
        if n.saturating_mul(each) > self.buf.len() - self.at {
            return Err(StateCodecError::Invalid { what, value: n as u64, at });
        }
        Ok(n)
    }

    #[inline]
    fn parent(&mut self, tag: u8, previous: Option<u64>, at: usize) -> Result<Option<u64>, StateCodecError> {
        match tag >> PARENT_SHIFT & 0b11 {
            PARENT_NONE => Ok(None),
            PARENT_PREVIOUS => previous.map(Some).ok_or(StateCodecError::Invalid {
                what: "parent (no previous block)",
                value: tag.into(),
                at,
            }),
            PARENT_EXPLICIT => self.u64("parent hash").map(Some),
            _ => Err(StateCodecError::Invalid { what: "parent", value: tag.into(), at }),
        }
    }

    fn load(&mut self) -> Result<LoadReport, StateCodecError> {
        let mut l = LoadReport {
            running: self.usize("load report")?,
            waiting: self.usize("load report")?,
            queued_prefill_tokens: self.usize("load report")?,
            incoming: self.usize("load report")?,
            receiving: self.usize("load report")?,
            leased: self.usize("load report")?,
            free_blocks: self.usize("load report")?,
            cached_blocks: self.usize("load report")?,
            evictable_blocks: self.usize("load report")?,
            total_blocks: self.usize("load report")?,
            step_time_us: self.u64("load report")?,
            decode_step_us: self.u64("load report")?,
            decode_step_batch: f64::from_bits(self.u64("load report")?),
            decode_step_context: f64::from_bits(self.u64("load report")?),
            ..LoadReport::default()
        };
        let at = self.at;
        l.role = match self.u8("role")? {
            0 => None,
            1 => Some(Role::Prefill),
            2 => Some(Role::Decode),
            3 => Some(Role::Colocated),
            other => return Err(StateCodecError::Invalid { what: "role", value: other.into(), at }),
        };
        let n = self.count("decode context count", 8)?;
        l.decode_contexts = (0..n).map(|_| self.usize("decode context")).collect::<Result<_, _>>()?;
        Ok(l)
    }
}

/// Turns the bytes of a state stream, as they arrive in chunks of any size, back into updates,
/// buffering at most one update (and the chunk that completes it): a frame announcing more
/// than [`MAX_FRAME_BYTES`], or a line longer than [`MAX_LINE_BYTES`], is an error as soon as
/// that is known.
#[derive(Debug)]
pub struct StateReader {
    format: StateFormat,
    buf: Vec<u8>,
    /// Bytes of `buf` already consumed.
    start: usize,
    /// Bytes of `buf` from `start` known to hold no newline (NDJSON).
    scanned: usize,
}

impl StateReader {
    /// A reader of a stream in `format`.
    pub fn new(format: StateFormat) -> Self {
        Self { format, buf: Vec::new(), start: 0, scanned: 0 }
    }

    /// The format it reads.
    pub fn format(&self) -> StateFormat {
        self.format
    }

    /// Bytes received and not yet consumed.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }

    /// Appends bytes the stream brought.
    pub fn extend(&mut self, bytes: &[u8]) {
        if self.start > 0 && self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        } else if self.start > self.buf.len() / 2 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole update received, `Ok(None)` until one is; an error ends the stream (the
    /// reader's place in it is lost).
    pub fn next_update(&mut self) -> Result<Option<StateUpdate>, StateCodecError> {
        match self.format {
            StateFormat::Binary => self.next_frame(),
            StateFormat::Ndjson => self.next_line(),
        }
    }

    fn next_frame(&mut self) -> Result<Option<StateUpdate>, StateCodecError> {
        let pending = &self.buf[self.start..];
        let Some(len) = frame_len(pending)? else { return Ok(None) };
        let Some(body) = pending.get(HEADER_BYTES..HEADER_BYTES + len) else { return Ok(None) };
        let update = decode_body(body)?;
        self.start += HEADER_BYTES + len;
        Ok(Some(update))
    }

    fn next_line(&mut self) -> Result<Option<StateUpdate>, StateCodecError> {
        loop {
            let pending = &self.buf[self.start..];
            let Some(end) = pending[self.scanned..].iter().position(|&b| b == b'\n').map(|i| self.scanned + i) else {
                self.scanned = pending.len();
                if pending.len() > MAX_LINE_BYTES {
                    return Err(StateCodecError::LineTooLong { max: MAX_LINE_BYTES });
                }
                return Ok(None);
            };
            if end > MAX_LINE_BYTES {
                return Err(StateCodecError::LineTooLong { max: MAX_LINE_BYTES });
            }
            let line = &pending[..end];
            self.start += end + 1;
            self.scanned = 0;
            if line.iter().all(u8::is_ascii_whitespace) {
                continue; // a blank line (a keep-alive)
            }
            return serde_json::from_slice(line).map(Some).map_err(|e| StateCodecError::Json(e.to_string()));
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn tier() -> impl Strategy<Value = KvTier> {
        prop_oneof![Just(KvTier::Device), Just(KvTier::Host), Just(KvTier::Disk)]
    }

    /// Hashes from a small set too, so parents often equal the entry before them.
    fn hash() -> impl Strategy<Value = u64> {
        prop_oneof![0u64..4, any::<u64>()]
    }

    fn block() -> impl Strategy<Value = CachedBlock> {
        (hash(), proptest::option::of(hash()), tier()).prop_map(|(hash, parent, tier)| CachedBlock {
            hash,
            parent,
            tier,
        })
    }

    fn change() -> impl Strategy<Value = BlockChange> {
        prop_oneof![
            block().prop_map(BlockChange::Stored),
            (hash(), tier()).prop_map(|(hash, tier)| BlockChange::Moved { hash, tier }),
            hash().prop_map(|hash| BlockChange::Removed { hash }),
        ]
    }

    /// Events numbered mostly in sequence, with jumps (and the wrap at `u64::MAX`) now and then.
    fn events() -> impl Strategy<Value = Vec<BlockEvent>> {
        (
            any::<u64>(),
            proptest::collection::vec(
                (change(), prop_oneof![4 => Just(None), 1 => any::<u64>().prop_map(Some)]),
                0..40,
            ),
        )
            .prop_map(|(first, changes)| {
                let mut seq = first;
                changes
                    .into_iter()
                    .map(|(change, jump)| {
                        let e = BlockEvent { seq, change };
                        seq = jump.unwrap_or(seq.wrapping_add(1));
                        e
                    })
                    .collect()
            })
    }

    fn load() -> impl Strategy<Value = LoadReport> {
        (
            proptest::collection::vec(any::<usize>(), 10),
            any::<(u64, u64)>(),
            any::<(f64, f64)>(),
            proptest::option::of(prop_oneof![Just(Role::Prefill), Just(Role::Decode), Just(Role::Colocated)]),
            proptest::collection::vec(any::<usize>(), 0..8),
        )
            .prop_map(|(n, (step_time_us, decode_step_us), (batch, context), role, decode_contexts)| {
                LoadReport {
                    running: n[0],
                    waiting: n[1],
                    queued_prefill_tokens: n[2],
                    incoming: n[3],
                    receiving: n[4],
                    leased: n[5],
                    free_blocks: n[6],
                    cached_blocks: n[7],
                    evictable_blocks: n[8],
                    total_blocks: n[9],
                    step_time_us,
                    decode_step_us,
                    decode_step_batch: batch,
                    decode_step_context: context,
                    role,
                    decode_contexts,
                }
            })
    }

    fn update() -> impl Strategy<Value = StateUpdate> {
        prop_oneof![
            (any::<u64>(), proptest::collection::vec(block(), 0..40), load(), any::<u64>())
                .prop_map(|(next_seq, blocks, load, at_ms)| StateUpdate::Snapshot { next_seq, blocks, load, at_ms }),
            (events(), load(), any::<u64>()).prop_map(|(events, load, at_ms)| StateUpdate::Delta {
                events,
                load,
                at_ms
            }),
        ]
    }

    /// Equality that holds for NaN loads too (`f64`s compared by their bits).
    fn same(a: &StateUpdate, b: &StateUpdate) -> bool {
        let bits = |u: &StateUpdate| (u.load().decode_step_batch.to_bits(), u.load().decode_step_context.to_bits());
        let plain = |u: &StateUpdate| {
            let mut u = u.clone();
            let l = match &mut u {
                StateUpdate::Snapshot { load, .. } | StateUpdate::Delta { load, .. } => load,
            };
            (l.decode_step_batch, l.decode_step_context) = (0.0, 0.0);
            u
        };
        bits(a) == bits(b) && plain(a) == plain(b)
    }

    proptest! {
        #[test]
        fn decode_inverts_encode(u in update()) {
            let mut frame = Vec::new();
            encode(&u, &mut frame).expect("encode");
            let back = decode(&frame).expect("decode");
            prop_assert!(same(&back, &u), "{back:?} != {u:?}");
        }

        #[test]
        fn a_reader_gets_every_update_whatever_the_chunks(
            updates in proptest::collection::vec(update(), 1..5),
            chunk in 1usize..64,
        ) {
            let mut stream = Vec::new();
            for u in &updates {
                encode(u, &mut stream).expect("encode");
            }
            let mut reader = StateReader::new(StateFormat::Binary);
            let mut got = Vec::new();
            for piece in stream.chunks(chunk) {
                reader.extend(piece);
                while let Some(u) = reader.next_update().expect("a whole stream") {
                    got.push(u);
                }
            }
            prop_assert_eq!(got.len(), updates.len());
            prop_assert!(got.iter().zip(&updates).all(|(a, b)| same(a, b)));
            prop_assert_eq!(reader.buffered(), 0);
        }

        #[test]
        fn a_truncated_frame_is_an_error_or_incomplete(u in update(), cut in any::<prop::sample::Index>()) {
            let mut frame = Vec::new();
            encode(&u, &mut frame).expect("encode");
            let cut = cut.index(frame.len());
            prop_assert!(decode(&frame[..cut]).is_err());
            let mut reader = StateReader::new(StateFormat::Binary);
            reader.extend(&frame[..cut]);
            prop_assert_eq!(reader.next_update(), Ok(None));
            // A body whose length field was shortened to match is refused, never misread.
            if cut > HEADER_BYTES {
                let mut short = frame[..cut].to_vec();
                short[2..6].copy_from_slice(&((cut - HEADER_BYTES) as u32).to_le_bytes());
                prop_assert!(decode(&short).is_err());
            }
        }

        #[test]
        fn garbled_frames_never_panic(
            u in update(),
            flips in proptest::collection::vec((any::<prop::sample::Index>(), 1u8..=255), 1..6),
        ) {
            let mut frame = Vec::new();
            encode(&u, &mut frame).expect("encode");
            for (at, x) in flips {
                let i = at.index(frame.len());
                frame[i] ^= x;
            }
            // Any result but a panic; a change the format cannot see decodes to some update.
            let _ = decode(&frame);
            let mut reader = StateReader::new(StateFormat::Binary);
            reader.extend(&frame);
            let _ = reader.next_update();
        }

        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode(&bytes);
            let mut framed = vec![MAGIC, VERSION];
            framed.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
            framed.extend_from_slice(&bytes);
            let _ = decode(&framed);
        }
    }

    #[test]
    fn a_prompt_chain_takes_nine_bytes_a_block() {
        let events: Vec<BlockEvent> = (0..100u64)
            .map(|i| BlockEvent {
                seq: 1000 + i,
                change: BlockChange::Stored(CachedBlock {
                    hash: i * 7919 + 1,
                    parent: (i > 0).then(|| (i - 1) * 7919 + 1),
                    tier: KvTier::Device,
                }),
            })
            .collect();
        let u = StateUpdate::Delta { events, load: LoadReport::default(), at_ms: 5 };
        let mut frame = Vec::new();
        encode(&u, &mut frame).expect("encode");
        let fixed = HEADER_BYTES + 1 + 8 + (14 * 8 + 1 + 4) + 4;
        assert_eq!(frame.len(), fixed + 8 + 100 * 9, "the first event carries its sequence number");
        assert_eq!(decode(&frame), Ok(u));
    }

    #[test]
    fn a_frame_announcing_too_much_is_refused_from_its_header() {
        let mut header = vec![MAGIC, VERSION];
        header.extend_from_slice(&((MAX_FRAME_BYTES + 1) as u32).to_le_bytes());
        let mut reader = StateReader::new(StateFormat::Binary);
        reader.extend(&header);
        assert!(matches!(reader.next_update(), Err(StateCodecError::TooLarge { .. })));
        assert_eq!(frame_len(&[MAGIC, 2, 0, 0, 0, 0]), Err(StateCodecError::Version(2)));
        assert_eq!(frame_len(b"{"), Err(StateCodecError::BadMagic(b'{')), "JSON is told apart at once");
    }

    #[test]
    fn an_ndjson_stream_reads_line_by_line_and_skips_blank_lines() {
        let u =
            StateUpdate::Delta { events: vec![], load: LoadReport { running: 2, ..LoadReport::default() }, at_ms: 3 };
        let mut stream = Vec::new();
        StateFormat::Ndjson.encode(&u, &mut stream).expect("encode");
        stream.push(b'\n');
        StateFormat::Ndjson.encode(&u, &mut stream).expect("encode");
        let mut reader = StateReader::new(StateFormat::Ndjson);
        let mut got = Vec::new();
        for b in stream.chunks(5) {
            reader.extend(b);
            while let Some(u) = reader.next_update().expect("valid") {
                got.push(u);
            }
        }
        assert_eq!(got, vec![u.clone(), u]);
        let mut reader = StateReader::new(StateFormat::Ndjson);
        reader.extend(b"{\"update\":\n");
        assert!(matches!(reader.next_update(), Err(StateCodecError::Json(_))));
    }

    #[test]
    fn negotiation_follows_the_headers() {
        assert_eq!(StateFormat::from_accept(["text/html, application/x-baton-state-v1;q=0.9"]), StateFormat::Binary);
        assert_eq!(StateFormat::from_accept(["*/*"]), StateFormat::Ndjson);
        assert_eq!(StateFormat::from_accept([]), StateFormat::Ndjson);
        assert_eq!(StateFormat::from_content_type(Some("application/x-baton-state-v1")), StateFormat::Binary);
        assert_eq!(StateFormat::from_content_type(Some("application/x-ndjson")), StateFormat::Ndjson);
        assert_eq!(StateFormat::from_content_type(None), StateFormat::Ndjson);
    }
}
