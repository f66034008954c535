//! Memory this backend allocates: device buffers, pinned host staging, and host memory
//! page-locked for the device; each freed (or unlocked) on drop.

use super::*;

/// Device memory this module allocated, freed on drop.
#[derive(Debug)]
pub(super) struct DevBuf {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) ptr: sys::CUdeviceptr,
    pub(super) bytes: usize,
}

impl DevBuf {
    pub(super) fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        ctx.bind_to_thread().map_err(err)?;
        // SAFETY: a plain allocation; a zero-byte request still gets a valid (unused) pointer.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes.max(256)) }
            .map_err(|e| err(format!("allocating {} MiB of device memory: {e}", bytes >> 20)))?;
        Ok(Self { ctx: ctx.clone(), ptr, bytes })
    }

    pub(super) fn at(&self, byte_offset: usize) -> u64 {
        debug_assert!(byte_offset <= self.bytes);
        self.ptr + byte_offset as u64
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from `malloc_sync` and is freed once; the owner's stream is
            // synchronised at the end of every step, so no kernel still uses it.
            let _ = unsafe { cudarc::driver::result::free_sync(self.ptr) };
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
