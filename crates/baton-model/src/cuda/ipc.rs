//! An engine's device KV arena as the transfer plane opens it ([`baton_transfer::DeviceArena`]),
//! and device-to-device copies of a transfer's runs on a stream of the link's own, beside the
//! engine's steps. The arena is one allocation, block-major like the host arena it mirrors, so a
//! run's offsets are the host descriptor's. It is shared one of two ways, by how it was made:
//!
//! - **A CUDA virtual-memory allocation** (`cuMemCreate`, the default): exported as a POSIX
//!   descriptor, which a peer fetches over a Unix socket ([`baton_transfer::share`]) and
//!   imports. The peer then holds the physical memory itself: copies it makes after the exporter
//!   died — a kill landing mid-copy — touch memory that is still there, and fail only at the
//!   answers that never come.
//! - **Legacy CUDA IPC** (a `cuMemAlloc` allocation, where the driver has no virtual memory
//!   management or `--kv-export ipc`): a `cuIpcGetMemHandle` handle. The memory dies with the
//!   exporter, so the transfer plane watches the exporting process and never copies after it
//!   died (`DeviceTransport`); a kill landing during a copy stays undefined.

use std::mem::MaybeUninit;

use baton_transfer::plan::RangeCopy;
use baton_transfer::share::FdShare;
use baton_transfer::{DeviceArena, DeviceHandle, DeviceHandleKind, DeviceLink, Location, TransferError};

use super::*;

/// Bytes of a CUDA IPC memory handle.
const IPC_HANDLE_LEN: usize = 64;

fn device_error(context: &'static str) -> impl Fn(cudarc::driver::DriverError) -> TransferError {
    move |e| TransferError::Device(format!("{context}: {e}"))
}

fn model_error(context: &'static str) -> impl Fn(ModelError) -> TransferError {
    move |e| TransferError::Device(format!("{context}: {e}"))
}

/// An engine's device arena, shared with its transfer threads.
#[derive(Debug)]
pub(super) struct CudaArena {
    cache: Arc<DevBuf>,
    location: Location,
    handle: DeviceHandle,
    /// Serves the allocation's descriptor to peers while the arena lives (a virtual-memory
    /// allocation's; none for legacy IPC).
    _share: Option<FdShare>,
}

impl CudaArena {
    /// The arena `cache` (an engine's), with the handle a peer opens it by made once: its
    /// descriptor served on a Unix socket when it is a virtual-memory allocation, a CUDA IPC
    /// handle when it is a plain one.
    pub(super) fn new(cache: Arc<DevBuf>) -> Result<Self> {
        let ctx = &cache.ctx;
        ctx.bind_to_thread().map_err(err)?;
        let uuid = ctx.uuid().map_err(err)?;
        let location = Location::Device { ordinal: ctx.ordinal() as u32, uuid: uuid.bytes.map(|b| b as u8) };
        let pid = std::process::id();
        if cache.is_mapped() {
            let (fd, mapped) = cache.export()?;
            let share = FdShare::serve(fd).map_err(|e| err(format!("sharing the device arena: {e}")))?;
            let mut bytes = (mapped as u64).to_le_bytes().to_vec();
            bytes.extend_from_slice(share.name());
            let handle = DeviceHandle { kind: DeviceHandleKind::CudaVmm, bytes, len: cache.bytes as u64, pid };
            return Ok(Self { cache, location, handle, _share: Some(share) });
        }
        let mut handle = MaybeUninit::<sys::CUipcMemHandle>::uninit();
        // SAFETY: `cache.ptr` is the base of a live `cuMemAlloc` allocation; the driver fills
        // the handle.
        let handle = unsafe {
            sys::cuIpcGetMemHandle(handle.as_mut_ptr(), cache.ptr).result().map_err(err)?;
            handle.assume_init()
        };
        let handle = DeviceHandle {
            kind: DeviceHandleKind::CudaIpc,
            bytes: handle.reserved.iter().map(|&b| b as u8).collect(),
            len: cache.bytes as u64,
            pid,
        };
        Ok(Self { cache, location, handle, _share: None })
    }

    /// Maps the arena a peer exported as a CUDA IPC handle (`bytes`) into this context.
    fn open_ipc(&self, bytes: &[u8]) -> baton_transfer::Result<Theirs> {
        if bytes.len() != IPC_HANDLE_LEN {
            return Err(TransferError::Protocol(format!("a CUDA IPC handle of {} bytes", bytes.len())));
        }
        let mut raw = sys::CUipcMemHandle { reserved: [0; IPC_HANDLE_LEN] };
        for (r, &b) in raw.reserved.iter_mut().zip(bytes) {
            *r = b as _;
        }
        let mut theirs: sys::CUdeviceptr = 0;
        // SAFETY: the handle came from a peer's `cuIpcGetMemHandle`; the driver maps its
        // allocation into this context (peer access enabled lazily when it is another device),
        // or fails (the same process, another IPC namespace).
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut theirs,
                raw,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint,
            )
        }
        .result()
        .map_err(device_error("opening the peer's device arena (CUDA IPC)"))?;
        Ok(Theirs::Ipc(theirs))
    }

    /// Imports the arena a peer exported as a virtual-memory allocation: `bytes` is the
    /// mapped size (8 bytes) and the name its descriptor is served under; `len` the bytes used.
    fn open_vmm(&self, bytes: &[u8], len: u64) -> baton_transfer::Result<Theirs> {
        let bad = || TransferError::Protocol(format!("a CUDA VMM handle of {} bytes", bytes.len()));
        let (mapped, name) = bytes.split_at_checked(8).ok_or_else(bad)?;
        let mapped = u64::from_le_bytes(mapped.try_into().map_err(|_| bad())?);
        let (mapped, len) = (usize::try_from(mapped).map_err(|_| bad())?, usize::try_from(len).map_err(|_| bad())?);
        let fd = baton_transfer::share::fetch(name)
            .map_err(|e| TransferError::Device(format!("receiving the peer's device arena: {e}")))?;
        let buf = DevBuf::import(&self.cache.ctx, fd, mapped, len)
            .map_err(model_error("importing the peer's device arena (CUDA VMM)"))?;
        Ok(Theirs::Imported(buf))
    }
}

impl DeviceArena for CudaArena {
    fn location(&self) -> Location {
        self.location
    }

    fn handle(&self) -> DeviceHandle {
        self.handle.clone()
    }

    fn open(
        &self,
        handle: &DeviceHandle,
        descriptor: &baton_kv::TensorDescriptor,
    ) -> baton_transfer::Result<Box<dyn DeviceLink>> {
        let span = (descriptor.base + descriptor.num_bytes()) as u64;
        if span > handle.len {
            return Err(TransferError::Protocol(format!(
                "the peer's device arena of {} bytes is shorter than its descriptor ({span})",
                handle.len
            )));
        }
        let ctx = &self.cache.ctx;
        ctx.bind_to_thread().map_err(device_error("binding the device"))?;
        let theirs = match handle.kind {
            DeviceHandleKind::CudaVmm => self.open_vmm(&handle.bytes, handle.len)?,
            DeviceHandleKind::CudaIpc => self.open_ipc(&handle.bytes)?,
            other => return Err(TransferError::Protocol(format!("a {other:?} device handle for a CUDA arena"))),
        };
        // On failure `theirs` drops, which closes or releases what was opened.
        let stream = ctx.new_stream().map_err(device_error("a copy stream"))?;
        Ok(Box::new(CudaLink { ours: Arc::clone(&self.cache), theirs, theirs_len: handle.len, stream }))
    }

    fn read_back(&self, offset: usize, buf: &mut [u8]) -> baton_transfer::Result<()> {
        if offset + buf.len() > self.cache.bytes {
            return Err(TransferError::OutOfBounds { offset, len: buf.len(), region_len: self.cache.bytes });
        }
        self.cache.ctx.bind_to_thread().map_err(device_error("binding the device"))?;
        // SAFETY: the range lies inside the allocation (checked); a synchronous copy.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(buf, self.cache.at(offset)) }
            .map_err(device_error("reading the device arena back"))
    }
}

/// The transfer benchmark's device (`baton bench transfer --device cuda`): arenas of any size
/// on one GPU, and its device-to-device copy bandwidth, the device path's limit.
#[derive(Debug)]
pub struct CudaBenchDevice {
    ctx: Arc<CudaContext>,
    export: KvExport,
}

impl CudaBenchDevice {
    /// The GPU with this ordinal, its arenas exported as `export` says.
    pub fn new(ordinal: usize, export: KvExport) -> Result<Self> {
        check_libraries()?;
        let ctx = CudaContext::new(ordinal).map_err(|e| err(format!("CUDA device {ordinal}: {e}")))?;
        Ok(Self { ctx, export })
    }
}

impl baton_transfer::bench::BenchDevice for CudaBenchDevice {
    fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "a CUDA device".into())
    }

    fn arena(
        &self,
        descriptor: &baton_kv::TensorDescriptor,
        fill: &[u8],
    ) -> baton_transfer::Result<Arc<dyn DeviceArena>> {
        let to_transfer = |e: ModelError| TransferError::Device(e.to_string());
        let len = descriptor.base + descriptor.num_bytes();
        let buf = DevBuf::for_sharing(&self.ctx, len, self.export).map_err(to_transfer)?;
        let chunk = baton_transfer::bench::fill_chunk(fill);
        let mut at = 0;
        while at < len && !chunk.is_empty() {
            let n = chunk.len().min(len - at);
            // SAFETY: `n` bytes inside the allocation; a synchronous copy.
            unsafe { cudarc::driver::result::memcpy_htod_sync(buf.at(at), &chunk[..n]) }
                .map_err(device_error("filling a device arena"))?;
            at += n;
        }
        Ok(Arc::new(CudaArena::new(Arc::new(buf)).map_err(to_transfer)?))
    }

    fn memcpy_gb_per_s(&self, len: usize) -> baton_transfer::Result<f64> {
        let to_transfer = |e: ModelError| TransferError::Device(e.to_string());
        let (a, b) =
            (DevBuf::new(&self.ctx, len).map_err(to_transfer)?, DevBuf::new(&self.ctx, len).map_err(to_transfer)?);
        let mut times = Vec::new();
        for _ in 0..6 {
            let t = std::time::Instant::now();
            // SAFETY: two allocations of `len` bytes; `cuMemcpyDtoD` is synchronous for the host.
            unsafe { sys::cuMemcpyDtoD_v2(b.ptr, a.ptr, len) }.result().map_err(device_error("cudaMemcpy D2D"))?;
            self.ctx.synchronize().map_err(device_error("synchronising"))?;
            times.push(t.elapsed().as_secs_f64());
        }
        times.remove(0);
        times.sort_by(f64::total_cmp);
        Ok(len as f64 / times[times.len() / 2] / 1e9)
    }
}

/// The peer's arena as a link holds it.
#[derive(Debug)]
enum Theirs {
    /// Opened from a CUDA IPC handle: valid while the exporter lives; closed on drop.
    Ipc(sys::CUdeviceptr),
    /// Imported from the exporter's descriptor: this process's to use until dropped.
    Imported(DevBuf),
}

impl Theirs {
    fn ptr(&self) -> sys::CUdeviceptr {
        match self {
            Theirs::Ipc(ptr) => *ptr,
            Theirs::Imported(buf) => buf.ptr,
        }
    }
}

/// An open link: the peer's arena mapped here, copies on a stream of the link's own.
#[derive(Debug)]
struct CudaLink {
    ours: Arc<DevBuf>,
    theirs: Theirs,
    theirs_len: u64,
    stream: Arc<CudaStream>,
}

// SAFETY: the peer's pointer is the context's, valid on any thread that binds it (every call
// does); copies on the link's stream are serialised by its owner (a transfer thread, or the
// server's writer lock).
unsafe impl Send for CudaLink {}
unsafe impl Sync for CudaLink {}

impl CudaLink {
    /// Enqueues each run from `(src, src_len)` into `(dst, dst_len)` and waits for them.
    fn copy(&self, copies: &[RangeCopy], pull: bool) -> baton_transfer::Result<()> {
        self.ours.ctx.bind_to_thread().map_err(device_error("binding the device"))?;
        let ours = (self.ours.ptr, self.ours.bytes as u64);
        let theirs = (self.theirs.ptr(), self.theirs_len);
        let (src, dst) = if pull { (theirs, ours) } else { (ours, theirs) };
        for c in copies {
            let (s, d) = (c.src, c.dst);
            if s.len != d.len || (s.offset + s.len) as u64 > src.1 || (d.offset + d.len) as u64 > dst.1 {
                return Err(TransferError::OutOfBounds { offset: d.offset, len: d.len, region_len: dst.1 as usize });
            }
            // SAFETY: both runs lie inside their allocations (checked); the destination blocks
            // are reserved for this transfer, so nothing else writes them meanwhile.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    dst.0 + d.offset as u64,
                    src.0 + s.offset as u64,
                    s.len,
                    self.stream.cu_stream(),
                )
            }
            .map_err(device_error("a device-to-device copy"))?;
        }
        self.stream.synchronize().map_err(device_error("waiting for device-to-device copies"))
    }
}

impl DeviceLink for CudaLink {
    fn pull(&self, copies: &[RangeCopy]) -> baton_transfer::Result<()> {
        self.copy(copies, true)
    }

    fn push(&self, copies: &[RangeCopy]) -> baton_transfer::Result<()> {
        self.copy(copies, false)
    }

    /// An imported allocation is this process's as much as the exporter's.
    fn outlives_exporter(&self) -> bool {
        matches!(self.theirs, Theirs::Imported(_))
    }
}

impl Drop for CudaLink {
    fn drop(&mut self) {
        // No copy in flight when the peer's arena goes (dropped after this, on this thread).
        if self.ours.ctx.bind_to_thread().is_ok() {
            let _ = self.stream.synchronize();
        }
    }
}

impl Drop for Theirs {
    /// Closes an IPC mapping (an imported allocation releases itself, [`DevBuf`]); its owner
    /// has bound the context and has no copy in flight.
    fn drop(&mut self) {
        if let Theirs::Ipc(ptr) = *self {
            // SAFETY: opened by `CudaArena::open_ipc`, closed once.
            let _ = unsafe { sys::cuIpcCloseMemHandle(ptr) };
        }
    }
}
