//! The crate's error type.

use std::io;

use crate::frame::{ErrorCode, FrameError};
use crate::lease::LeaseError;
use crate::plan::PlanError;
use crate::{PeerId, TransferId};

/// Everything a transfer can fail with. A peer's refusal arrives as [`TransferError::Remote`]
/// with the [`ErrorCode`] it sent.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// A socket or mapping call failed (timeouts included: `WouldBlock` / `TimedOut`).
    #[error("I/O error while {context}: {source}")]
    Io {
        /// What we were doing.
        context: &'static str,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A wait ran past its deadline.
    #[error("timed out after {millis} ms while {context}")]
    Timeout {
        /// What we were waiting for.
        context: &'static str,
        /// How long we waited.
        millis: u64,
    },
    /// The peer closed the connection.
    #[error("peer closed the connection while {0}")]
    PeerClosed(&'static str),
    /// Bytes on the wire that do not decode into a frame of this protocol.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The two sides cannot exchange KV (model, dtype, block size, geometry or layout version).
    #[error("incompatible peer: {0}")]
    Incompatible(String),
    /// The peer does not know the cluster secret (or we do not know its).
    #[error("authentication failed: {0}")]
    AuthFailed(&'static str),
    /// The block lists cannot be planned.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// A lease operation was refused.
    #[error(transparent)]
    Lease(#[from] LeaseError),
    /// The peer answered with an ERROR frame.
    #[error("peer {peer} refused transfer {id}: {code:?}: {message}")]
    Remote {
        /// The peer.
        peer: PeerId,
        /// The transfer (zero for connection-level errors).
        id: TransferId,
        /// What kind of refusal.
        code: ErrorCode,
        /// The peer's explanation.
        message: String,
    },
    /// The peer sent a frame that is valid but not expected here.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// A byte range falls outside a region.
    #[error("range {offset}+{len} is outside the {region_len}-byte region")]
    OutOfBounds {
        /// First byte.
        offset: usize,
        /// Length.
        len: usize,
        /// Region size.
        region_len: usize,
    },
    /// The TLS handshake failed: the peer's certificate is not trusted or does not name its
    /// address, the peer does not speak TLS, or the handshake ran out of time.
    #[error("TLS with the peer failed: {0}")]
    Tls(String),
    /// The requested transport needs something this peer or region does not offer.
    #[error("transport unavailable: {0}")]
    Unavailable(&'static str),
    /// The transport insisted on cannot reach this peer (the reason names which side lacks
    /// what: another host, no device arena, no shared memory offered).
    #[error("the transport asked for cannot reach the peer: {0}")]
    Unreachable(String),
    /// A device call failed (opening a peer's device arena, a device-to-device copy).
    #[error("device: {0}")]
    Device(String),
    /// KV bytes that arrived over TCP did not match the checksums their sender computed: the
    /// transfer failed, and its destination blocks hold garbage (the caller frees them and
    /// computes their tokens again).
    #[error("{blocks} KV blocks of transfer {id} from peer {peer} arrived damaged (checksum mismatch)")]
    Corrupt {
        /// The sender.
        peer: PeerId,
        /// The transfer.
        id: TransferId,
        /// Destination blocks with at least one damaged byte range.
        blocks: usize,
    },
}

impl TransferError {
    /// A failed TLS handshake.
    pub(crate) fn tls(e: io::Error) -> Self {
        TransferError::Tls(e.to_string())
    }

    /// Wraps an I/O error, turning socket timeouts into [`TransferError::Timeout`]-like errors
    /// that still carry their context.
    pub(crate) fn io(context: &'static str) -> impl FnOnce(io::Error) -> TransferError {
        move |source| match source.kind() {
            io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => {
                TransferError::PeerClosed(context)
            }
            _ => TransferError::Io { context, source },
        }
    }

    /// Blocks that arrived damaged, when the error is [`TransferError::Corrupt`] (what a worker
    /// counts beside the blocks that failed their check on its own tiers).
    pub fn corrupt_blocks(&self) -> usize {
        match self {
            TransferError::Corrupt { blocks, .. } => *blocks,
            _ => 0,
        }
    }

    /// Whether the error means the data read for a transfer cannot be trusted (the caller must
    /// drop its destination blocks).
    pub fn is_remote(&self) -> bool {
        matches!(self, TransferError::Remote { .. })
    }
}

/// Result alias of the crate.
pub type Result<T, E = TransferError> = std::result::Result<T, E>;
