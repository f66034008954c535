//! Where a side's KV bytes live and how a peer can reach them, as agreed at CONNECT; and the
//! choice of transport that follows from the two sides' facts. No I/O but reading this host's
//! identity once.
//!
//! Each side says which machine it is on ([`HostId`]), where its engine keeps KV
//! ([`Location`]: host memory, or device N), and the handles a peer on the same machine may
//! open: its region's shared-memory handle, and its device arena's exported handle
//! ([`DeviceHandle`]: a CUDA VMM allocation's descriptor, or a legacy CUDA IPC handle).
//! [`choose`] then picks the transport for a pair, the fastest both can use: device to device
//! when both arenas are on devices of one host and each side can open the other's, shared
//! memory when they share a host, TCP otherwise. A side that must not be reached some way (a
//! worker told `--transport tcp`) offers no handle for it.

use std::sync::OnceLock;

/// A machine's identity as the transfer plane sees it: two endpoints with the same one can map
/// each other's memory. It is the kernel's boot id (new at every boot) combined with this
/// process's PID namespace, because a peer's region is opened through `/proc/<pid>/fd/<fd>`,
/// which only a process in the same PID namespace can resolve: two containers on one kernel
/// are different hosts here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HostId(pub [u8; 16]);

impl HostId {
    /// This process's host. Where the boot id cannot be read, a random id: no peer shares it,
    /// so every peer is reached over TCP (always correct, never the fastest).
    pub fn this() -> HostId {
        static THIS: OnceLock<HostId> = OnceLock::new();
        *THIS.get_or_init(|| {
            let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok();
            let namespace = std::fs::read_link("/proc/self/ns/pid").ok();
            match (boot, namespace) {
                (Some(boot), Some(ns)) => HostId::from_parts(boot.trim(), &ns.to_string_lossy()),
                _ => HostId(crate::auth::nonce()),
            }
        })
    }

    /// The id of a host with boot id `boot` whose process runs in PID namespace `namespace`.
    pub fn from_parts(boot: &str, namespace: &str) -> HostId {
        let mut id = [0u8; 16];
        id[..8].copy_from_slice(&baton_kv::fnv1a_64(boot.as_bytes()).to_le_bytes());
        id[8..].copy_from_slice(&baton_kv::fnv1a_64(namespace.as_bytes()).to_le_bytes());
        HostId(id)
    }
}

/// Where an engine keeps the KV it computes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Location {
    /// Host memory (a CPU engine).
    #[default]
    Host,
    /// GPU memory of one device of the host.
    Device {
        /// The device's ordinal in the owning process (for messages; CUDA numbers devices per
        /// process, so it is not an identity).
        ordinal: u32,
        /// The device's UUID, which is: two processes with different `CUDA_VISIBLE_DEVICES`
        /// name the same GPU by it.
        uuid: [u8; 16],
    },
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Location::Host => f.write_str("host memory"),
            Location::Device { ordinal, .. } => write!(f, "device {ordinal}"),
        }
    }
}

/// Where a peer's region can be mapped from on the same host (`/proc/<pid>/fd/<fd>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShmHandle {
    /// Owning process.
    pub pid: u32,
    /// The memfd's descriptor number there.
    pub fd: i32,
    /// Bytes of the region.
    pub len: u64,
}

/// What kind of device handle a [`DeviceHandle`] carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceHandleKind {
    /// A CUDA IPC memory handle (`cuIpcGetMemHandle`) of the allocation holding the arena. The
    /// allocation dies with its exporter: a peer must not touch it after that (see
    /// [`crate::transport::DeviceTransport`]).
    CudaIpc,
    /// Host memory standing in for a device (tests and machines without a GPU): the bytes name
    /// an [`FdShare`](crate::share::FdShare) serving the region's memfd, so the device path's
    /// protocol runs where no device is. Shared as [`DeviceHandleKind::CudaVmm`] is, and like
    /// it outlives its exporter in a peer that opened it.
    StandIn,
    /// A CUDA virtual-memory allocation (`cuMemCreate`), exported as a POSIX file descriptor
    /// (`cuMemExportToShareableHandle`): the bytes are the allocation's mapped size (8,
    /// little-endian) and the name of the [`FdShare`](crate::share::FdShare) serving it. A peer that imported it holds the physical memory itself, so its copies stay
    /// defined when the exporter dies mid-copy.
    CudaVmm,
}

impl DeviceHandleKind {
    pub(crate) fn code(self) -> u8 {
        match self {
            DeviceHandleKind::CudaIpc => 1,
            DeviceHandleKind::StandIn => 2,
            DeviceHandleKind::CudaVmm => 3,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(DeviceHandleKind::CudaIpc),
            2 => Some(DeviceHandleKind::StandIn),
            3 => Some(DeviceHandleKind::CudaVmm),
            _ => None,
        }
    }
}

/// Most bytes of a [`DeviceHandle`] (a CUDA IPC handle is 64; a descriptor share's name and
/// size, about 40).
pub const MAX_DEVICE_HANDLE: usize = 256;

/// How a process on the same host opens a device arena: an exported handle of the allocation
/// holding it, opened once per peer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DeviceHandle {
    /// What the bytes are.
    pub kind: DeviceHandleKind,
    /// The handle itself (at most [`MAX_DEVICE_HANDLE`] bytes).
    pub bytes: Vec<u8>,
    /// Bytes of the arena behind it.
    pub len: u64,
    /// The process that exported it (0: not said). A peer on the same host watches it
    /// ([`crate::transport::DeviceTransport`]): a dead exporter's CUDA IPC memory must not be
    /// touched, and what a peer holds of any dead exporter's arena is let go.
    pub pid: u32,
}

/// Where a side's KV is and how a peer may reach it: what CONNECT and ACCEPT carry besides the
/// layout.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Reach {
    /// The side's host ([`HostId::this`]); `None` from a side that does not say.
    pub host: Option<HostId>,
    /// Where its engine keeps KV.
    pub location: Location,
    /// Its region's shared-memory handle, when it offers one.
    pub shm: Option<ShmHandle>,
    /// Its device arena's handle, when it offers one.
    pub device: Option<DeviceHandle>,
}

impl Reach {
    /// Whether `other` is on this side's host (both said, and the same).
    pub fn same_host(&self, other: &Reach) -> bool {
        matches!((self.host, other.host), (Some(a), Some(b)) if a == b)
    }
}

/// Which transport a side asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TransportChoice {
    /// The fastest the two sides can both use: device to device, else shared memory, else TCP.
    #[default]
    Auto,
    /// Device to device only (both arenas on devices of one host).
    Device,
    /// Shared memory only (one host).
    Shm,
    /// TCP only.
    Tcp,
}

impl std::str::FromStr for TransportChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "device" => Ok(Self::Device),
            "shm" => Ok(Self::Shm),
            "tcp" => Ok(Self::Tcp),
            other => Err(format!("unknown transport `{other}` (expected auto, device, shm or tcp)")),
        }
    }
}

impl From<crate::TransportKind> for TransportChoice {
    fn from(kind: crate::TransportKind) -> Self {
        match kind {
            crate::TransportKind::Device => TransportChoice::Device,
            crate::TransportKind::Shm => TransportChoice::Shm,
            crate::TransportKind::Tcp => TransportChoice::Tcp,
        }
    }
}

impl TransportChoice {
    /// Whether a side with this choice offers its shared-memory handle.
    pub fn offers_shm(self) -> bool {
        matches!(self, TransportChoice::Auto | TransportChoice::Shm)
    }

    /// Whether a side with this choice offers its device handle.
    pub fn offers_device(self) -> bool {
        matches!(self, TransportChoice::Auto | TransportChoice::Device)
    }
}

/// The transports to try for a pair, fastest first: `ours` (this side's facts) reaching
/// `theirs` (the peer's, from CONNECT or ACCEPT), as `choice` allows. Empty with the reason when
/// `choice` names a transport the pair cannot use. A device path needs both arenas on devices
/// and handles of one kind; shared memory a handle of the peer's; both one host. TCP always
/// works, so `Auto` ends with it: a caller falls back down the list when opening one fails (a
/// peer in another IPC namespace, a device that cannot map the other's memory).
pub fn choose(ours: &Reach, theirs: &Reach, choice: TransportChoice) -> Result<Vec<crate::TransportKind>, String> {
    use crate::TransportKind;
    let same_host = ours.same_host(theirs);
    let device = match (&ours.device, &theirs.device) {
        (Some(a), Some(b)) if same_host && a.kind == b.kind => Ok(()),
        (Some(a), Some(b)) if same_host => Err(format!("device handles of two kinds ({:?}, {:?})", a.kind, b.kind)),
        (Some(_), Some(_)) => Err("the peer is on another host".to_owned()),
        (None, _) => Err(format!("this side's KV is in {} with no device handle", ours.location)),
        (_, None) => Err(format!("the peer's KV is in {} with no device handle", theirs.location)),
    };
    let shm = match &theirs.shm {
        Some(_) if same_host => Ok(()),
        Some(_) => Err("the peer is on another host".to_owned()),
        None => Err("the peer offers no shared memory".to_owned()),
    };
    match choice {
        TransportChoice::Tcp => Ok(vec![TransportKind::Tcp]),
        TransportChoice::Device => device.map(|()| vec![TransportKind::Device]),
        TransportChoice::Shm => shm.map(|()| vec![TransportKind::Shm]),
        TransportChoice::Auto => {
            let mut kinds = Vec::with_capacity(3);
            if device.is_ok() {
                kinds.push(TransportKind::Device);
            }
            if shm.is_ok() {
                kinds.push(TransportKind::Shm);
            }
            kinds.push(TransportKind::Tcp);
            Ok(kinds)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TransportKind::{Device, Shm, Tcp};

    fn host(n: u8) -> Option<HostId> {
        Some(HostId([n; 16]))
    }

    fn shm() -> Option<ShmHandle> {
        Some(ShmHandle { pid: 1, fd: 3, len: 64 })
    }

    fn gpu(kind: DeviceHandleKind) -> (Location, Option<DeviceHandle>) {
        (
            Location::Device { ordinal: 0, uuid: [7; 16] },
            Some(DeviceHandle { kind, bytes: vec![1; 64], len: 64, pid: 1 }),
        )
    }

    fn reach(host_n: u8, device: Option<DeviceHandleKind>) -> Reach {
        let (location, device) = device.map_or((Location::Host, None), gpu);
        Reach { host: host(host_n), location, shm: shm(), device }
    }

    #[test]
    fn auto_takes_the_fastest_path_the_pair_shares_and_ends_with_tcp() {
        let cuda = Some(DeviceHandleKind::CudaIpc);
        assert_eq!(choose(&reach(1, cuda), &reach(1, cuda), TransportChoice::Auto), Ok(vec![Device, Shm, Tcp]));
        // A CPU worker and a GPU worker of one host: their host regions.
        assert_eq!(choose(&reach(1, None), &reach(1, cuda), TransportChoice::Auto), Ok(vec![Shm, Tcp]));
        assert_eq!(choose(&reach(1, cuda), &reach(1, None), TransportChoice::Auto), Ok(vec![Shm, Tcp]));
        // Another host: TCP, whatever handles it offers.
        assert_eq!(choose(&reach(1, cuda), &reach(2, cuda), TransportChoice::Auto), Ok(vec![Tcp]));
        // A peer that does not say where it is is not on this host.
        let unknown = Reach { host: None, ..reach(1, cuda) };
        assert_eq!(choose(&reach(1, cuda), &unknown, TransportChoice::Auto), Ok(vec![Tcp]));
        // Handles of two kinds cannot open each other.
        let stand_in = Some(DeviceHandleKind::StandIn);
        assert_eq!(choose(&reach(1, cuda), &reach(1, stand_in), TransportChoice::Auto), Ok(vec![Shm, Tcp]));
        // A peer offering no shared memory: TCP (a worker told `--transport tcp`).
        let closed = Reach { shm: None, device: None, ..reach(1, None) };
        assert_eq!(choose(&reach(1, None), &closed, TransportChoice::Auto), Ok(vec![Tcp]));
    }

    #[test]
    fn a_forced_transport_the_pair_cannot_use_says_why() {
        let cuda = Some(DeviceHandleKind::CudaIpc);
        let err = choose(&reach(1, None), &reach(1, cuda), TransportChoice::Device).expect_err("refused");
        assert!(err.contains("host memory with no device handle"), "{err}");
        let err = choose(&reach(1, cuda), &reach(2, cuda), TransportChoice::Device).expect_err("refused");
        assert!(err.contains("another host"), "{err}");
        let err = choose(&reach(1, None), &reach(2, None), TransportChoice::Shm).expect_err("refused");
        assert!(err.contains("another host"), "{err}");
        assert_eq!(choose(&reach(1, cuda), &reach(1, cuda), TransportChoice::Tcp), Ok(vec![Tcp]));
        assert_eq!(choose(&reach(1, cuda), &reach(1, cuda), TransportChoice::Shm), Ok(vec![Shm]));
    }

    #[test]
    fn this_host_is_stable_and_parts_tell_hosts_and_namespaces_apart() {
        assert_eq!(HostId::this(), HostId::this());
        let a = HostId::from_parts("boot-a", "pid:[1]");
        assert_eq!(a, HostId::from_parts("boot-a", "pid:[1]"));
        assert_ne!(a, HostId::from_parts("boot-b", "pid:[1]"));
        assert_ne!(a, HostId::from_parts("boot-a", "pid:[2]"));
    }
}
