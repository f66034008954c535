//! The KV arena: one contiguous region holding every block of an instance (or of one tier).
//!
//! The region is a memfd mapped shared, so another process on the same host can map it
//! read-only through an [`ArenaHandle`] (`/proc/<pid>/fd/<fd>`) and read KV with no copy through
//! this process: the same-host analogue of CUDA IPC handles. Where a memfd cannot be created
//! (or the arena is empty) it falls back to private heap memory and has no handle.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;

use memmap2::{Mmap, MmapMut};

use crate::{BlockId, KvDtype, KvGeometry, KvLayout, KvPart, TensorDescriptor};

#[derive(Debug)]
enum Backing {
    /// A shared mapping of a memfd.
    Shared { map: MmapMut, file: File },
    /// Private memory (no handle), in `f32` words (4-byte aligned for any element type).
    Heap(Vec<f32>),
}

/// One block's `[T][H][D]` keys or values of one layer, in the element type the arena stores.
#[derive(Debug, Clone, Copy)]
pub enum Slab<'a> {
    /// float32.
    F32(&'a [f32]),
    /// IEEE float16.
    F16(&'a [half::f16]),
    /// bfloat16.
    Bf16(&'a [half::bf16]),
}

impl Slab<'_> {
    /// Elements in the slab.
    pub fn len(&self) -> usize {
        match self {
            Slab::F32(s) => s.len(),
            Slab::F16(s) => s.len(),
            Slab::Bf16(s) => s.len(),
        }
    }

    /// Whether the slab has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `n` rows of `width` elements, `stride` apart from `start`, into `out` (row after
    /// row, `n · width` floats), widening 16-bit elements to float32 exactly.
    ///
    /// Attention widens one head's rows of one block at a time (16 rows of 64 elements), so the
    /// per-row cost matters: float16 goes through the CPU's F16C conversion (checked once per
    /// call, not per row) and bfloat16 through a shift the compiler vectorises. A call per row
    /// into `half`'s slice conversion cost decode with a 16-bit cache 10–20% of its speed
    /// against float32 (`baton bench engine --kv-dtype f16`).
    pub fn rows_to_f32(&self, start: usize, stride: usize, n: usize, width: usize, out: &mut [f32]) {
        let out = &mut out[..n * width];
        if n == 0 {
            return;
        }
        match self {
            Slab::F32(s) => {
                for (t, o) in out.chunks_exact_mut(width).enumerate() {
                    o.copy_from_slice(&s[start + t * stride..][..width]);
                }
            }
            Slab::F16(s) => {
                assert!(start + (n - 1) * stride + width <= s.len(), "rows past the slab");
                #[cfg(target_arch = "x86_64")]
                if width.is_multiple_of(8) && std::arch::is_x86_feature_detected!("f16c") {
                    // SAFETY: the CPU has F16C (and so AVX), checked just above; the assert
                    // bounds every row read and `out` holds `n · width` floats.
                    #[allow(unsafe_code)]
                    unsafe {
                        f16_rows_to_f32(s, start, stride, n, width, out);
                    }
                    return;
                }
                use half::slice::HalfFloatSliceExt;
                for (t, o) in out.chunks_exact_mut(width).enumerate() {
                    s[start + t * stride..][..width].convert_to_f32_slice(o);
                }
            }
            Slab::Bf16(s) => {
                // A bfloat16 is the high half of the float32 with the same value.
                for (t, o) in out.chunks_exact_mut(width).enumerate() {
                    for (x, b) in o.iter_mut().zip(&s[start + t * stride..][..width]) {
                        *x = f32::from_bits(u32::from(b.to_bits()) << 16);
                    }
                }
            }
        }
    }
}

/// [`Slab::rows_to_f32`] for float16 rows whose width is a multiple of 8, eight elements an
/// instruction.
///
/// # Safety
/// The CPU must have F16C; `s` must hold `n` rows of `width` elements `stride` apart from
/// `start`, and `out` `n · width` floats.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx,f16c")]
unsafe fn f16_rows_to_f32(s: &[half::f16], start: usize, stride: usize, n: usize, width: usize, out: &mut [f32]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm256_cvtph_ps, _mm256_storeu_ps};
    for t in 0..n {
        let (src, dst) = (s[start + t * stride..][..width].as_ptr(), out[t * width..][..width].as_mut_ptr());
        for c in (0..width).step_by(8) {
            // SAFETY: `c + 8 <= width`, and both rows hold `width` elements (the slices above).
            unsafe { _mm256_storeu_ps(dst.add(c), _mm256_cvtph_ps(_mm_loadu_si128(src.add(c).cast::<__m128i>()))) };
        }
    }
}

/// The memfd name of an arena made without one.
pub const DEFAULT_ARENA_NAME: &str = "baton-kv-arena";

/// Creates a memfd of `len` bytes and maps it read-write, shared.
fn shared_region(name: &str, len: usize) -> io::Result<(MmapMut, File)> {
    let fd: OwnedFd = rustix::fs::memfd_create(name, rustix::fs::MemfdFlags::CLOEXEC)?;
    let file = File::from(fd);
    file.set_len(len as u64)?;
    let map = map_shared_mut(&file)?;
    Ok((map, file))
}

#[allow(unsafe_code)]
fn map_shared_mut(file: &File) -> io::Result<MmapMut> {
    // SAFETY: the file is a memfd this module created and sized; it is never truncated
    // afterwards, so the mapping stays valid for as long as it lives. Other mappings of it (a
    // `shared_view`, a transfer peer's) write only blocks the pool has handed to them, never
    // those our `&mut` views are in use for; the bytes are plain data, never Rust values.
    unsafe { MmapMut::map_mut(file) }
}

/// All KV blocks of one instance in one region of its geometry's element type (float32, or a
/// 16-bit one: half the bytes), laid out as its [`TensorDescriptor`] says. The arena knows
/// addresses, not owners: which blocks are in use is the allocator's business.
#[derive(Debug)]
pub struct KvArena {
    geometry: KvGeometry,
    descriptor: TensorDescriptor,
    backing: Backing,
}

impl KvArena {
    /// A zeroed arena of `num_blocks` blocks, in shared memory when the host allows it.
    pub fn new(geometry: KvGeometry, layout: KvLayout, num_blocks: usize) -> Self {
        Self::new_shared(geometry, layout, num_blocks)
            .unwrap_or_else(|_| Self::new_private(geometry, layout, num_blocks))
    }

    /// A zeroed arena of `num_blocks` blocks in a memfd another process can map.
    pub fn new_shared(geometry: KvGeometry, layout: KvLayout, num_blocks: usize) -> io::Result<Self> {
        Self::new_named(DEFAULT_ARENA_NAME, geometry, layout, num_blocks)
    }

    /// [`new_shared`](Self::new_shared), its memfd named `name` (what `/proc/PID/maps` and
    /// `smaps` show as `/memfd:NAME`, so a process's arenas can be told apart: a stand-in
    /// device's from a host tier's).
    pub fn new_named(name: &str, geometry: KvGeometry, layout: KvLayout, num_blocks: usize) -> io::Result<Self> {
        let descriptor = TensorDescriptor::new(&geometry, layout, num_blocks);
        let len = descriptor.num_elems() * geometry.dtype.size();
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "an empty arena cannot be shared"));
        }
        let (map, file) = shared_region(name, len)?;
        Ok(Self { geometry, descriptor, backing: Backing::Shared { map, file } })
    }

    /// A zeroed arena of `num_blocks` blocks in private heap memory (no handle).
    pub fn new_private(geometry: KvGeometry, layout: KvLayout, num_blocks: usize) -> Self {
        let descriptor = TensorDescriptor::new(&geometry, layout, num_blocks);
        let data = vec![0.0; (descriptor.num_elems() * geometry.dtype.size()).div_ceil(4)];
        Self { geometry, descriptor, backing: Backing::Heap(data) }
    }

    /// The arena's geometry.
    pub fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    /// The arena's descriptor (layout, shape, strides).
    pub fn descriptor(&self) -> &TensorDescriptor {
        &self.descriptor
    }

    /// Number of blocks the arena holds.
    pub fn num_blocks(&self) -> usize {
        self.descriptor.extent(crate::Dim::Block)
    }

    /// A second view of this arena's memory for another thread of this process (a mapping of
    /// its own of the same memfd): what one view writes, the other reads. The caller keeps the
    /// views to disjoint blocks at any one time (the pool's owners decide which). Fails for an
    /// arena in private memory.
    pub fn shared_view(&self) -> io::Result<KvArena> {
        match &self.backing {
            Backing::Shared { file, .. } => {
                let file = file.try_clone()?;
                let map = map_shared_mut(&file)?;
                let backing = Backing::Shared { map, file };
                Ok(Self { geometry: self.geometry, descriptor: self.descriptor.clone(), backing })
            }
            Backing::Heap(_) => Err(io::Error::new(io::ErrorKind::Unsupported, "the arena is in private memory")),
        }
    }

    /// The handle another process on this host can map the arena with, if it is shared.
    pub fn handle(&self) -> Option<ArenaHandle> {
        match &self.backing {
            Backing::Shared { file, map } => Some(ArenaHandle {
                pid: std::process::id(),
                fd: file.as_raw_fd(),
                len: map.len(),
                descriptor: self.descriptor.clone(),
            }),
            Backing::Heap(_) => None,
        }
    }

    /// The `[T][H][D]` slab of keys or values of one block in one layer, in the stored type.
    pub fn slab(&self, layer: usize, part: KvPart, block: BlockId) -> Slab<'_> {
        let start = self.descriptor.offset(layer, part, block.index(), 0, 0);
        let range = start..start + self.geometry.slab_elems();
        match self.geometry.dtype {
            KvDtype::F32 => Slab::F32(&self.as_slice()[range]),
            KvDtype::F16 => Slab::F16(&self.halves()[range]),
            KvDtype::Bf16 => Slab::Bf16(&self.bhalves()[range]),
        }
    }

    /// Asks the CPU to bring kv head `head`'s keys and values of one block in one layer into
    /// cache (a hint: nothing is read, nothing can fault). Decode attention calls it for the
    /// next block while it works on one: a step's context is never in cache (the step's weights
    /// have passed through since the last), and one head's rows are short strided runs that the
    /// hardware prefetchers do not follow from block to block.
    ///
    /// Each slot's row is found from the first slot's and the token stride, not through
    /// [`TensorDescriptor::offset`] per slot (which looks up five dimensions' strides each
    /// call): `perf record` of `bench engine --batches 1,1,1,1 --prompt-len 1 --decode-steps
    /// 256` (SmolLM2 135M, two threads) put 1.5% of the samples here and in `offset`, now 0.7%.
    pub fn prefetch_head(&self, layer: usize, block: BlockId, head: usize) {
        let g = &self.geometry;
        let elem = g.dtype.size();
        let base = self.as_bytes().as_ptr();
        let slot_bytes = self.descriptor.stride(crate::Dim::Token) * elem;
        for part in [KvPart::Key, KvPart::Value] {
            let first = self.descriptor.offset(layer, part, block.index(), 0, head) * elem;
            for slot in 0..g.block_size {
                let start = first + slot * slot_bytes;
                for line in (0..g.head_dim * elem).step_by(64) {
                    crate::hash_table::prefetch(base.wrapping_add(start + line));
                }
            }
        }
    }

    /// Stores the `[H][D]` keys or values of one token slot in one layer (rounded to nearest
    /// in a 16-bit arena).
    pub fn write_token(&mut self, layer: usize, part: KvPart, block: BlockId, slot: usize, values: &[f32]) {
        use half::slice::HalfFloatSliceExt;
        let start = self.descriptor.offset(layer, part, block.index(), slot, 0);
        let range = start..start + self.geometry.token_elems();
        match self.geometry.dtype {
            KvDtype::F32 => self.as_mut_slice()[range].copy_from_slice(values),
            KvDtype::F16 => self.halves_mut()[range].convert_from_f32_slice(values),
            KvDtype::Bf16 => self.bhalves_mut()[range].convert_from_f32_slice(values),
        }
    }

    /// The `[T][H][D]` slab of keys or values of one block in one layer of a float32 arena.
    ///
    /// # Panics
    /// If the arena holds 16-bit KV (use [`KvArena::slab`]).
    pub fn block(&self, layer: usize, part: KvPart, block: BlockId) -> &[f32] {
        let start = self.descriptor.offset(layer, part, block.index(), 0, 0);
        &self.as_slice()[start..start + self.geometry.slab_elems()]
    }

    /// The `[H][D]` keys or values of one token slot in one layer of a float32 arena, for
    /// writing.
    ///
    /// # Panics
    /// If the arena holds 16-bit KV (use [`KvArena::write_token`]).
    pub fn token_mut(&mut self, layer: usize, part: KvPart, block: BlockId, slot: usize) -> &mut [f32] {
        let start = self.descriptor.offset(layer, part, block.index(), slot, 0);
        let n = self.geometry.token_elems();
        &mut self.as_mut_slice()[start..start + n]
    }

    /// The whole region of a float32 arena, in descriptor order.
    ///
    /// # Panics
    /// If the arena holds 16-bit KV (its bytes are [`KvArena::as_bytes`]).
    pub fn as_slice(&self) -> &[f32] {
        assert_eq!(self.geometry.dtype, KvDtype::F32, "a 16-bit arena has no float32 view");
        bytemuck::cast_slice(self.as_bytes())
    }

    /// The whole region of a float32 arena, mutable, in descriptor order.
    ///
    /// # Panics
    /// If the arena holds 16-bit KV.
    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        assert_eq!(self.geometry.dtype, KvDtype::F32, "a 16-bit arena has no float32 view");
        bytemuck::cast_slice_mut(self.as_bytes_mut())
    }

    fn halves(&self) -> &[half::f16] {
        use half::slice::HalfBitsSliceExt;
        bytemuck::cast_slice::<u8, u16>(self.as_bytes()).reinterpret_cast()
    }

    fn halves_mut(&mut self) -> &mut [half::f16] {
        use half::slice::HalfBitsSliceExt;
        bytemuck::cast_slice_mut::<u8, u16>(self.as_bytes_mut()).reinterpret_cast_mut()
    }

    fn bhalves(&self) -> &[half::bf16] {
        use half::slice::HalfBitsSliceExt;
        bytemuck::cast_slice::<u8, u16>(self.as_bytes()).reinterpret_cast()
    }

    fn bhalves_mut(&mut self) -> &mut [half::bf16] {
        use half::slice::HalfBitsSliceExt;
        bytemuck::cast_slice_mut::<u8, u16>(self.as_bytes_mut()).reinterpret_cast_mut()
    }

    /// Bytes in the region.
    fn len_bytes(&self) -> usize {
        self.descriptor.num_elems() * self.geometry.dtype.size()
    }

    /// The whole region as bytes (what [`TensorDescriptor::byte_ranges`] indexes).
    pub fn as_bytes(&self) -> &[u8] {
        let len = self.len_bytes();
        match &self.backing {
            Backing::Shared { map, .. } => &map[..len],
            Backing::Heap(v) => &bytemuck::cast_slice(v)[..len],
        }
    }

    /// The whole region as mutable bytes.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        let len = self.len_bytes();
        match &mut self.backing {
            Backing::Shared { map, .. } => &mut map[..len],
            Backing::Heap(v) => &mut bytemuck::cast_slice_mut(v)[..len],
        }
    }

    /// Copies every element of `src` blocks onto `dst` blocks of `other`, which may have another
    /// layout but must have the same geometry. Used to move a sequence's KV between arenas.
    pub fn copy_blocks_from(&mut self, other: &KvArena, src: &[BlockId], dst: &[BlockId]) {
        assert_eq!(self.geometry, other.geometry, "copy between arenas of different geometry");
        self.copy_blocks_from_bytes(&other.descriptor, other.as_bytes(), src, dst);
    }

    /// Copies `src` blocks of a region described by `src_desc` (another arena, possibly mapped
    /// from another process, with this arena's geometry in any layout) onto `dst` blocks here.
    pub fn copy_blocks_from_bytes(
        &mut self,
        src_desc: &TensorDescriptor,
        from_all: &[u8],
        src: &[BlockId],
        dst: &[BlockId],
    ) {
        assert_eq!(src.len(), dst.len(), "copy needs as many destination blocks as sources");
        let same_layout = self.descriptor.dims == src_desc.dims;
        let geometry = self.geometry;
        let size = geometry.dtype.size();
        let n = geometry.slab_elems() * size;
        let descriptor = self.descriptor.clone();
        let to_all = self.as_bytes_mut();
        for (&s, &d) in src.iter().zip(dst) {
            if same_layout && src_desc.dims[0] == crate::Dim::Block {
                // Block-major on both sides: one copy per block.
                let len = geometry.block_elems() * size;
                let from = src_desc.offset(0, KvPart::Key, s.index(), 0, 0) * size;
                let to = descriptor.offset(0, KvPart::Key, d.index(), 0, 0) * size;
                to_all[to..to + len].copy_from_slice(&from_all[from..from + len]);
                continue;
            }
            for layer in 0..geometry.layers {
                for part in [KvPart::Key, KvPart::Value] {
                    let from = src_desc.offset(layer, part, s.index(), 0, 0) * size;
                    let to = descriptor.offset(layer, part, d.index(), 0, 0) * size;
                    to_all[to..to + n].copy_from_slice(&from_all[from..from + n]);
                }
            }
        }
    }
}

/// What another process on the same host needs to map an arena read-only: the owner's pid and
/// file descriptor (reachable as `/proc/<pid>/fd/<fd>`), the region's length and its descriptor.
/// Valid while the owning arena lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArenaHandle {
    /// Process owning the arena.
    pub pid: u32,
    /// The memfd's descriptor number in that process.
    pub fd: i32,
    /// Bytes in the region.
    pub len: usize,
    /// Layout of the region.
    pub descriptor: TensorDescriptor,
}

impl ArenaHandle {
    /// The path through which another process opens the memfd.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/fd/{}", self.pid, self.fd))
    }

    /// Encodes the handle's location as `pid:fd:len` (the descriptor travels separately, e.g.
    /// in the transfer handshake).
    pub fn to_token(&self) -> String {
        format!("{}:{}:{}", self.pid, self.fd, self.len)
    }
}

/// A read-only mapping of another process's arena.
#[derive(Debug)]
pub struct MappedArena {
    map: Mmap,
}

impl MappedArena {
    /// Maps the arena `handle` names, read-only.
    pub fn open(handle: &ArenaHandle) -> io::Result<Self> {
        Self::open_path(&handle.path(), handle.len)
    }

    /// Maps `len` bytes of the memfd at `path` (a `/proc/<pid>/fd/<fd>` path), read-only.
    pub fn open_path(path: &std::path::Path, len: usize) -> io::Result<Self> {
        let file = File::open(path)?;
        let map = map_read_only(&file)?;
        if map.len() < len {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "arena is shorter than its handle says"));
        }
        Ok(Self { map })
    }

    /// The region's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.map
    }

    /// The region as float32 elements.
    pub fn as_slice(&self) -> &[f32] {
        bytemuck::cast_slice(&self.map)
    }
}

#[allow(unsafe_code)]
fn map_read_only(file: &File) -> io::Result<Mmap> {
    // SAFETY: the mapping is read-only; the owner keeps the memfd at a fixed size for the
    // arena's whole life. The owner may write while we read, so readers get bytes, never
    // references into Rust values of the owner, and treat concurrently written blocks as
    // not-yet-valid (the transfer protocol orders reads after COMPLETE of the writes).
    unsafe { Mmap::map(file) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Widening is exact on every path (F16C, the bfloat16 shift, and rows whose width is no
    /// multiple of 8): each element equals `half`'s own conversion, bit for bit, subnormals,
    /// infinities, signed zeros and strided rows included.
    #[test]
    fn rows_widen_exactly_as_half_converts() {
        let specials = [0.0f32, -0.0, 1.0, -2.5, 65504.0, 6.0e-8, -3.0e-5, f32::INFINITY, f32::NEG_INFINITY, 1.0e-40];
        let values: Vec<f32> = (0..96).map(|i| specials[i % specials.len()] * (1.0 + i as f32 / 7.0)).collect();
        let f16: Vec<half::f16> = values.iter().map(|&v| half::f16::from_f32(v)).collect();
        let bf16: Vec<half::bf16> = values.iter().map(|&v| half::bf16::from_f32(v)).collect();
        // Rows of `width` elements, `stride` apart, from element 3.
        for (width, stride) in [(16, 24), (8, 8), (5, 11)] {
            let n = (values.len() - 3 - width) / stride + 1;
            let mut out = vec![f32::NAN; n * width];
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            Slab::F16(&f16).rows_to_f32(3, stride, n, width, &mut out);
            let want: Vec<f32> =
                (0..n).flat_map(|t| f16[3 + t * stride..][..width].iter().map(|h| h.to_f32())).collect();
            assert_eq!(bits(&out), bits(&want), "f16, width {width}");
            Slab::Bf16(&bf16).rows_to_f32(3, stride, n, width, &mut out);
            let want: Vec<f32> =
                (0..n).flat_map(|t| bf16[3 + t * stride..][..width].iter().map(|h| h.to_f32())).collect();
            assert_eq!(bits(&out), bits(&want), "bf16, width {width}");
        }
    }
}
