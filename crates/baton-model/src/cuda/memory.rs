//! Memory this backend allocates: device buffers, pinned host staging, and host memory
//! page-locked for the device; each freed (or unlocked) on drop.

use super::*;

/// Device memory this module allocated (or imported), freed on drop.
#[derive(Debug)]
pub(super) struct DevBuf {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) ptr: sys::CUdeviceptr,
    pub(super) bytes: usize,
    alloc: Alloc,
}

/// How a [`DevBuf`]'s memory came to be, and so how it goes.
#[derive(Debug)]
enum Alloc {
    /// `cuMemAlloc`.
    Plain,
    /// A CUDA virtual-memory allocation — made here (`cuMemCreate`, exportable as a POSIX
    /// descriptor) or imported from another process's descriptor — mapped whole at `ptr`
    /// (`mapped` bytes, a multiple of the allocation granularity). The physical memory lives
    /// while any process holds a handle of it.
    Mapped { handle: sys::CUmemGenericAllocationHandle, mapped: usize },
}

/// The properties of a device allocation on `ctx`'s device that exports as a POSIX descriptor.
fn exportable_prop(ctx: &CudaContext) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct; all-zero is its "nothing asked" value, the fields that matter
    // are set below.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location = device_location(ctx);
    prop
}

fn device_location(ctx: &CudaContext) -> sys::CUmemLocation {
    sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ctx.cu_device() }
}

/// Maps allocation `handle` (`mapped` bytes) at a fresh address range of this process and
/// lets `ctx`'s device read and write it; the address, or an error with nothing left behind.
fn map_whole(ctx: &CudaContext, handle: sys::CUmemGenericAllocationHandle, mapped: usize) -> Result<sys::CUdeviceptr> {
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: reserving a range of virtual addresses only.
    unsafe { sys::cuMemAddressReserve(&mut ptr, mapped, 0, 0, 0) }
        .result()
        .map_err(|e| err(format!("reserving {} MiB of device addresses: {e}", mapped >> 20)))?;
    // SAFETY: the range was just reserved, `mapped` bytes, and the allocation is `mapped`
    // bytes: the whole of it goes at the range's start.
    let done = unsafe { sys::cuMemMap(ptr, mapped, 0, handle, 0) }.result().and_then(|()| {
        let access = sys::CUmemAccessDesc {
            location: device_location(ctx),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range is mapped; one descriptor.
        unsafe { sys::cuMemSetAccess(ptr, mapped, &access, 1) }.result().inspect_err(|_| {
            // SAFETY: mapped just above, unmapped once.
            let _ = unsafe { sys::cuMemUnmap(ptr, mapped) };
        })
    });
    if let Err(e) = done {
        // SAFETY: reserved above, nothing mapped in it any more.
        let _ = unsafe { sys::cuMemAddressFree(ptr, mapped) };
        return Err(err(format!("mapping a device allocation: {e}")));
    }
    Ok(ptr)
}

impl DevBuf {
    pub(super) fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        ctx.bind_to_thread().map_err(err)?;
        // SAFETY: a plain allocation; a zero-byte request still gets a valid (unused) pointer.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes.max(256)) }
            .map_err(|e| err(format!("allocating {} MiB of device memory: {e}", bytes >> 20)))?;
        Ok(Self { ctx: ctx.clone(), ptr, bytes, alloc: Alloc::Plain })
    }

    /// `bytes` of device memory that another process on this host can import and that outlives
    /// this process there ([`DevBuf::export`]): a CUDA virtual-memory allocation. An error where
    /// the device or driver has none (then [`DevBuf::new`] and legacy CUDA IPC serve).
    pub(super) fn exportable(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        ctx.bind_to_thread().map_err(err)?;
        let prop = exportable_prop(ctx);
        let mut granularity = 0usize;
        // SAFETY: `prop` is a valid property struct; the driver writes one size.
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        }
        .result()
        .map_err(|e| err(format!("the device's allocation granularity: {e}")))?;
        let mapped = bytes.max(1).div_ceil(granularity.max(1)) * granularity.max(1);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `mapped` is a multiple of the granularity the driver gave for `prop`.
        unsafe { sys::cuMemCreate(&mut handle, mapped, &prop, 0) }
            .result()
            .map_err(|e| err(format!("allocating {} MiB of exportable device memory: {e}", mapped >> 20)))?;
        match map_whole(ctx, handle, mapped) {
            Ok(ptr) => Ok(Self { ctx: ctx.clone(), ptr, bytes, alloc: Alloc::Mapped { handle, mapped } }),
            Err(e) => {
                // SAFETY: created above, never mapped, released once.
                let _ = unsafe { sys::cuMemRelease(handle) };
                Err(e)
            }
        }
    }

    /// `bytes` of device memory for peers to open: exportable ([`DevBuf::exportable`]) unless
    /// the driver cannot or `export` is [`KvExport::Ipc`], else plain (shared by legacy CUDA
    /// IPC).
    pub(super) fn for_sharing(ctx: &Arc<CudaContext>, bytes: usize, export: KvExport) -> Result<Self> {
        if export == KvExport::Vmm {
            match Self::exportable(ctx, bytes) {
                Ok(buf) => return Ok(buf),
                Err(e) => tracing::info!(error = %e, "a plain device allocation instead: peers open it by CUDA IPC"),
            }
        }
        Self::new(ctx, bytes)
    }

    /// A POSIX descriptor of this allocation (one made by [`DevBuf::exportable`]) for another
    /// process to import, and the bytes it spans there.
    pub(super) fn export(&self) -> Result<(std::os::fd::OwnedFd, usize)> {
        use std::os::fd::FromRawFd;
        let Alloc::Mapped { handle, mapped } = self.alloc else {
            return Err(err("a plain device allocation cannot be exported as a descriptor"));
        };
        self.ctx.bind_to_thread().map_err(err)?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: for a POSIX descriptor handle the driver writes one `int` at the pointer.
        unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast::<c_void>(),
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        }
        .result()
        .map_err(|e| err(format!("exporting the device arena: {e}")))?;
        if fd < 0 {
            return Err(err("exporting the device arena gave no descriptor"));
        }
        // SAFETY: a fresh descriptor the driver opened for us, owned from here on.
        Ok((unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }, mapped))
    }

    /// Imports another process's allocation from the descriptor it exported (`mapped` bytes,
    /// of which the first `bytes` are used) into `ctx`: the allocation is then this process's
    /// too, and lives while this buffer does, whatever becomes of the exporter.
    pub(super) fn import(
        ctx: &Arc<CudaContext>,
        fd: std::os::fd::OwnedFd,
        mapped: usize,
        bytes: usize,
    ) -> Result<Self> {
        use std::os::fd::AsRawFd;
        if bytes > mapped {
            return Err(err(format!("an imported allocation of {mapped} bytes cannot hold {bytes}")));
        }
        ctx.bind_to_thread().map_err(err)?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: for a POSIX descriptor the "OS handle" is the descriptor's number cast to a
        // pointer; the driver takes its own reference, so ours closes on return.
        unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        }
        .result()
        .map_err(|e| err(format!("importing a peer's device arena: {e}")))?;
        drop(fd);
        match map_whole(ctx, handle, mapped) {
            Ok(ptr) => Ok(Self { ctx: ctx.clone(), ptr, bytes, alloc: Alloc::Mapped { handle, mapped } }),
            Err(e) => {
                // SAFETY: imported above, never mapped, released once.
                let _ = unsafe { sys::cuMemRelease(handle) };
                Err(e)
            }
        }
    }

    /// Whether the memory is a virtual-memory allocation (one that outlives its exporter in
    /// the processes that imported it).
    pub(super) fn is_mapped(&self) -> bool {
        matches!(self.alloc, Alloc::Mapped { .. })
    }

    pub(super) fn at(&self, byte_offset: usize) -> u64 {
        debug_assert!(byte_offset <= self.bytes);
        self.ptr + byte_offset as u64
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        // The owner's stream is synchronised at the end of every step (a link's at the end of
        // every copy), so no kernel or copy still uses the memory.
        match self.alloc {
            // SAFETY: `ptr` came from `malloc_sync` and is freed once.
            Alloc::Plain => {
                let _ = unsafe { cudarc::driver::result::free_sync(self.ptr) };
            }
            // SAFETY: mapped whole at `ptr` by `map_whole`, which reserved the range; each
            // undone once, in reverse. The physical memory goes with the last handle anywhere.
            Alloc::Mapped { handle, mapped } => unsafe {
                let _ = sys::cuMemUnmap(self.ptr, mapped);
                let _ = sys::cuMemAddressFree(self.ptr, mapped);
                let _ = sys::cuMemRelease(handle);
            },
        }
    }
}

/// Page-locked host memory, for the copies every step makes (the batch's indices up, logits
/// and new KV down): a pageable copy goes through the driver's own staging, synchronously and
/// chunk by chunk, which measured milliseconds a step on a virtual machine.
pub(super) struct Pinned {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) ptr: *mut u8,
    pub(super) bytes: usize,
}

// SAFETY: the memory is plain host memory owned by this value; the raw pointer is what makes
// the type !Send, not any thread affinity.
unsafe impl Send for Pinned {}

impl Pinned {
    pub(super) fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        ctx.bind_to_thread().map_err(err)?;
        // SAFETY: a plain allocation of `bytes` (at least one page).
        let ptr = unsafe { cudarc::driver::result::malloc_host(bytes.max(4096), 0) }
            .map_err(|e| err(format!("allocating {} MiB of pinned host memory: {e}", bytes >> 20)))?;
        Ok(Self { ctx: ctx.clone(), ptr: ptr.cast(), bytes })
    }

    pub(super) fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        assert!(len <= self.bytes);
        // SAFETY: `ptr` holds `bytes` bytes owned by `self`, borrowed mutably here.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, len) }
    }

    pub(super) fn bytes(&self, len: usize) -> &[u8] {
        assert!(len <= self.bytes);
        // SAFETY: as `bytes_mut`, borrowed shared.
        unsafe { std::slice::from_raw_parts(self.ptr, len) }
    }

    pub(super) fn floats(&self, len: usize) -> &[f32] {
        assert!(len * 4 <= self.bytes);
        // SAFETY: page-aligned memory owned by `self`; any bytes are a valid `f32`.
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<f32>(), len) }
    }

    /// A buffer of at least `bytes`, reallocated (contents lost) when `slot` holds less.
    pub(super) fn at_least<'a>(
        slot: &'a mut Option<Pinned>,
        ctx: &Arc<CudaContext>,
        bytes: usize,
    ) -> Result<&'a mut Pinned> {
        if slot.as_ref().is_none_or(|p| p.bytes < bytes) {
            *slot = None;
            *slot = Some(Pinned::new(ctx, bytes.next_power_of_two())?);
        }
        Ok(slot.as_mut().expect("allocated"))
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: from `malloc_host`, freed once; the owner's copies are synchronised.
            let _ = unsafe { cudarc::driver::result::free_host(self.ptr.cast()) };
        }
    }
}

/// Host memory registered with the driver (`cuMemHostRegister`), unregistered on drop. The
/// engine drops its device state before its pool, so the memory outlives the registration.
pub(super) struct HostPinned {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) ptr: *mut c_void,
}

// SAFETY: a registration names host memory by address; it has no thread affinity.
unsafe impl Send for HostPinned {}

impl HostPinned {
    /// Registers `bytes`, or says why not.
    pub(super) fn new(ctx: &Arc<CudaContext>, bytes: &[u8]) -> Result<Self> {
        ctx.bind_to_thread().map_err(err)?;
        let ptr = bytes.as_ptr() as *mut c_void;
        // SAFETY: `bytes` is live host memory of this length; registration only pins it (the
        // driver writes it only through copies this module enqueues).
        unsafe { sys::cuMemHostRegister_v2(ptr, bytes.len(), sys::CU_MEMHOSTREGISTER_PORTABLE) }
            .result()
            .map_err(err)?;
        Ok(Self { ctx: ctx.clone(), ptr })
    }
}

impl Drop for HostPinned {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: registered by `new`, unregistered once; the owner's copies are synchronised.
            let _ = unsafe { sys::cuMemHostUnregister(self.ptr) };
        }
    }
}
