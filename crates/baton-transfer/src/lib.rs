//! KV transfer for Baton: KVDirect's tensor-centric protocol, coalesced, over shared memory and
//! TCP.
//!
//! A prefill worker exposes its KV region through a [`KvServer`]; a decode worker connects with a
//! [`KvClient`] (CONNECT: descriptors, geometry and a compatibility hash go both ways, and each
//! side proves it knows the cluster secret), then for every request pulls the prefill side's
//! blocks into its own (TRANSFER, reads, one COMPLETE). The [planner](mod@plan) turns two block lists
//! into the fewest byte-range copies for any pair of layouts; a [transport] executes
//! them: device-to-device copies between two arenas on GPUs of one host, one-sided `memcpy`
//! from the peer's mapped region on the same host, or vectored range reads over TCP. Which one
//! a pair uses follows from what each side says at CONNECT: its host, where its KV lives, the
//! handles it offers ([`location`]). Blocks the prefill side holds for a transfer are under a [lease]: COMPLETE
//! releases them, and so does the lease running out, after which reads are refused.
//! In push mode the decode side registers blocks it reserved and the prefill side writes into
//! them ([`KvServer::push_offered`]); the decode side watches many such pushes at once
//! ([`KvClient::poll_pushes`]) and may withdraw one ([`KvClient::cancel_push`]).
//!
//! The modules, bottom up:
//!
//! | module | what | I/O |
//! |---|---|---|
//! | [`frame`] | wire format: header, CONNECT … ERROR, explicit little-endian | none |
//! | [`mod@plan`] | block lists → coalesced `(src, dst)` byte-range copies | none |
//! | [`lease`] | the lease table, time passed in | none |
//! | [`compat`], [`auth`] | compatibility hash, HMAC proofs | none |
//! | [`location`] | where each side's KV lives, how a peer reaches it, the transport a pair uses | none |
//! | [`device`] | device arenas a peer opens and copies between; host memory standing in for one | copies |
//! | [`region`] | a KV region in a memfd: created, or a second mapping of an arena or a peer's | mmap |
//! | [`share`] | a descriptor handed to a peer process over a Unix socket (a device arena's) | sockets |
//! | [`transport`] | the `Transport` trait; device (watching its exporter's pidfd), shared memory and TCP | copies, sockets, pidfd |
//! | [`tls`] | TLS sessions over the blocking sockets, shared by a reader and a writer | sockets |
//! | `server` | [`KvServer`]: acceptor, connection threads, lease reaper, push | sockets |
//! | `client` | [`KvClient`]: connect, pull, push receive | sockets |
//! | [`mod@bench`] | the transfer benchmark between two processes | processes |

mod admit;
pub mod auth;
pub mod bench;
mod client;
pub mod compat;
mod conn;
pub mod device;
mod error;
pub mod frame;
pub mod lease;
pub mod location;
pub mod plan;
pub mod region;
mod server;
pub mod share;
pub mod tls;
pub mod transport;

pub use client::{ClientConfig, KvClient, NaiveUnit};
pub use region::{Access, Region};
pub use server::{BlockOwner, HANDSHAKE_MAX_META, KvServer, ServerConfig};
pub use tls::KvTls;
pub use transport::{DeviceTransport, ShmTransport, TcpLimits, TcpTransport, Transport, TransportKind};

pub use device::{DeviceArena, DeviceLink, StandInArena};
pub use location::{DeviceHandle, DeviceHandleKind, HostId, Location, Reach, ShmHandle, TransportChoice};

pub use compat::{Compat, LAYOUT_VERSION};
pub use error::{Result, TransferError};
pub use frame::{EndpointInfo, ErrorCode, Frame, TransferMode};
pub use lease::{LeaseError, LeaseTable, Release, ReleaseReason};
pub use plan::{PlanError, RangeCopy, TransferPlan, plan, plan_layers};

/// Identifies one request's transfer between two peers (the engine's request id fits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferId(pub u64);

impl std::fmt::Display for TransferId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "xfer#{}", self.0)
    }
}

/// Identifies a worker taking part in transfers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u64);

impl std::fmt::Display for PeerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "peer#{}", self.0)
    }
}

/// What one transfer took.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct TransferStats {
    /// Bytes moved.
    pub bytes: u64,
    /// Planned copies (contiguous runs on both sides).
    pub copies: usize,
    /// Transport calls made (memcpys, READ or WRITE frames, per-block round trips).
    pub calls: usize,
    /// Wall time.
    pub elapsed: std::time::Duration,
    /// The transport that moved the bytes.
    pub transport: TransportKind,
}
