//! Parsing the header, metadata and tensor table out of a file's bytes. No I/O: the caller
//! hands in the bytes (a memory map, or a buffer in tests) and gets a [`GgufHeader`] back.
//!
//! Layout (GGUF v2/v3, all little-endian): magic `GGUF`, u32 version, u64 tensor count, u64
//! metadata count; the metadata as (string key, u32 type, value); the tensor table as (string
//! name, u32 n_dims, u64 × n_dims `ne` innermost first, u32 ggml type, u64 offset); padding to
//! `general.alignment` (default 32); then the data section, each tensor at its offset from the
//! section's start.

use std::collections::HashSet;
use std::path::Path;

use crate::error::GgufError;
use crate::metadata::GgufMetadata;
use crate::tensor::{GgmlTypeId, GgufTensorInfo};
use crate::value::{GgufArray, GgufValue, GgufValueType};

/// The four magic bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and of each tensor when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that overrides [`DEFAULT_ALIGNMENT`].
pub const ALIGNMENT_KEY: &str = "general.alignment";
const MAX_DIMS: u32 = 4;
const MAX_ARRAY_DEPTH: usize = 8;

/// Everything before the data section.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    /// Format version (2 or 3; they share a layout).
    pub version: u32,
    /// The metadata.
    pub metadata: GgufMetadata,
    /// The tensor table, in file order.
    pub tensors: Vec<GgufTensorInfo>,
    /// Alignment of the data section and of each tensor's offset.
    pub alignment: u64,
    /// Byte offset of the data section from the start of the file.
    pub data_offset: u64,
}

/// Parses a whole file's bytes; `path` only names the file in errors. Checks that every tensor
/// of a known type lies inside the data section and starts on the alignment.
pub fn parse_header(bytes: &[u8], path: &Path) -> Result<GgufHeader, GgufError> {
    let mut r = Cursor { bytes, pos: 0, path };
    let magic = r.take(4)?;
    if magic != GGUF_MAGIC {
        return Err(r.error_at(0, format!("magic is {magic:02x?}, expected \"GGUF\"")));
    }
    let version = r.u32()?;
    match version {
        2 | 3 => {}
        1 => return Err(r.error_at(4, "GGUF v1 is not supported (v2 and v3 are)".into())),
        v if v.swap_bytes() <= 3 => return Err(r.error_at(4, "big-endian GGUF is not supported".into())),
        v => return Err(r.error_at(4, format!("unknown GGUF version {v}"))),
    }
    let tensor_count = r.u64()?;
    let kv_count = r.u64()?;
    // Bound the counts by what the rest of the file could hold before allocating for them.
    r.check_count(kv_count, 8 + 4 + 1, "metadata entries")?;
    r.check_count(tensor_count, 8 + 4 + 4 + 8, "tensors")?;

    let mut metadata = GgufMetadata::new(path);
    for _ in 0..kv_count {
        let key = r.string("a metadata key")?;
        let type_at = r.pos;
        let tag = r.u32()?;
        let ty = GgufValueType::from_id(tag)
            .ok_or_else(|| r.error_at(type_at, format!("metadata key `{key}` has unknown value type {tag}")))?;
        let value = r.value(ty, &key, 0)?;
        metadata.insert(key, value);
    }

    let alignment = match metadata.value(ALIGNMENT_KEY) {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_i128().and_then(|a| u64::try_from(a).ok()) {
            Some(a) if a.is_power_of_two() => a,
            _ => return Err(metadata.invalid(ALIGNMENT_KEY, format!("is {v:?}, expected a power of two"))),
        },
    };

    let mut tensors = Vec::with_capacity(usize::try_from(tensor_count).unwrap_or(0));
    let mut names = HashSet::new();
    for _ in 0..tensor_count {
        let at = r.pos;
        let name = r.string("a tensor name")?;
        let n_dims = r.u32()?;
        if n_dims > MAX_DIMS {
            return Err(r.error_at(at, format!("tensor `{name}` has {n_dims} dimensions, at most {MAX_DIMS}")));
        }
        let mut shape = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let d = r.u64()?;
            shape.push(usize::try_from(d).map_err(|_| r.error_at(at, format!("tensor `{name}` dimension {d}")))?);
        }
        shape.reverse();
        if shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).is_none() {
            return Err(r.error_at(at, format!("tensor `{name}` shape {shape:?} overflows")));
        }
        let ggml_type = GgmlTypeId(r.u32()?);
        let offset = r.u64()?;
        if !offset.is_multiple_of(alignment) {
            return Err(r.error_at(at, format!("tensor `{name}` offset {offset} is not a multiple of {alignment}")));
        }
        if !names.insert(name.clone()) {
            return Err(r.error_at(at, format!("tensor `{name}` appears twice")));
        }
        tensors.push(GgufTensorInfo { name, shape, ggml_type, offset });
    }

    let data_offset = (r.pos as u64).div_ceil(alignment) * alignment;
    let data_len = (bytes.len() as u64).saturating_sub(data_offset);
    for t in &tensors {
        let Some(len) = t.byte_len() else { continue };
        if t.offset.checked_add(len as u64).is_none_or(|end| end > data_len) {
            return Err(r.error_at(
                data_offset + t.offset,
                format!(
                    "tensor `{}` ({} {:?}, {len} bytes at data offset {}) runs past the end of the file",
                    t.name, t.ggml_type, t.shape, t.offset
                ),
            ));
        }
    }
    Ok(GgufHeader { version, metadata, tensors, alignment, data_offset })
}

/// A read position over the file's bytes. Every read is bounds-checked and little-endian.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn error_at(&self, offset: impl TryInto<u64>, reason: String) -> GgufError {
        GgufError::Malformed { path: self.path.to_owned(), offset: offset.try_into().unwrap_or(u64::MAX), reason }
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(self.error_at(self.pos, format!("needs {n} more bytes, the file has {}", self.remaining())));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn check_count(&self, count: u64, min_each: u64, what: &str) -> Result<(), GgufError> {
        if count.saturating_mul(min_each) > self.remaining() as u64 {
            return Err(self.error_at(
                self.pos,
                format!("header declares {count} {what}, more than the {} remaining bytes can hold", self.remaining()),
            ));
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let at = self.pos;
        let len = self.u64()?;
        let len = usize::try_from(len).map_err(|_| self.error_at(at, format!("{what}: length {len}")))?;
        let raw = self.take(len)?;
        match std::str::from_utf8(raw) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(self.error_at(at, format!("{what} is not UTF-8: {e}"))),
        }
    }

    fn value(&mut self, ty: GgufValueType, key: &str, depth: usize) -> Result<GgufValue, GgufError> {
        Ok(match ty {
            GgufValueType::U8 => GgufValue::U8(u8::from_le_bytes(self.array()?)),
            GgufValueType::I8 => GgufValue::I8(i8::from_le_bytes(self.array()?)),
            GgufValueType::U16 => GgufValue::U16(u16::from_le_bytes(self.array()?)),
            GgufValueType::I16 => GgufValue::I16(i16::from_le_bytes(self.array()?)),
            GgufValueType::U32 => GgufValue::U32(u32::from_le_bytes(self.array()?)),
            GgufValueType::I32 => GgufValue::I32(i32::from_le_bytes(self.array()?)),
            GgufValueType::U64 => GgufValue::U64(u64::from_le_bytes(self.array()?)),
            GgufValueType::I64 => GgufValue::I64(i64::from_le_bytes(self.array()?)),
            GgufValueType::F32 => GgufValue::F32(f32::from_le_bytes(self.array()?)),
            GgufValueType::F64 => GgufValue::F64(f64::from_le_bytes(self.array()?)),
            GgufValueType::Bool => GgufValue::Bool(self.bool(key)?),
            GgufValueType::String => GgufValue::String(self.string(&format!("the value of `{key}`"))?),
            GgufValueType::Array => GgufValue::Array(self.array_value(key, depth)?),
        })
    }

    fn bool(&mut self, key: &str) -> Result<bool, GgufError> {
        let at = self.pos;
        match self.array::<1>()?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(self.error_at(at, format!("`{key}`: bool byte is {b}, expected 0 or 1"))),
        }
    }

    fn array_value(&mut self, key: &str, depth: usize) -> Result<GgufArray, GgufError> {
        let at = self.pos;
        if depth >= MAX_ARRAY_DEPTH {
            return Err(self.error_at(at, format!("`{key}`: arrays nested deeper than {MAX_ARRAY_DEPTH}")));
        }
        let tag = self.u32()?;
        let ty = GgufValueType::from_id(tag)
            .ok_or_else(|| self.error_at(at, format!("`{key}`: array of unknown value type {tag}")))?;
        let n = self.u64()?;
        self.check_count(n, ty.min_size(), &format!("elements in the array `{key}`"))?;
        // `check_count` bounds n by the file size, so it fits in memory terms.
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        macro_rules! fixed {
            ($variant:ident, $t:ty) => {{
                let raw = self.take(n * std::mem::size_of::<$t>())?;
                GgufArray::$variant(
                    raw.chunks_exact(std::mem::size_of::<$t>())
                        .map(|c| {
                            let mut b = [0u8; std::mem::size_of::<$t>()];
                            b.copy_from_slice(c);
                            <$t>::from_le_bytes(b)
                        })
                        .collect(),
                )
            }};
        }
        Ok(match ty {
            GgufValueType::U8 => fixed!(U8, u8),
            GgufValueType::I8 => fixed!(I8, i8),
            GgufValueType::U16 => fixed!(U16, u16),
            GgufValueType::I16 => fixed!(I16, i16),
            GgufValueType::U32 => fixed!(U32, u32),
            GgufValueType::I32 => fixed!(I32, i32),
            GgufValueType::U64 => fixed!(U64, u64),
            GgufValueType::I64 => fixed!(I64, i64),
            GgufValueType::F32 => fixed!(F32, f32),
            GgufValueType::F64 => fixed!(F64, f64),
            GgufValueType::Bool => GgufArray::Bool((0..n).map(|_| self.bool(key)).collect::<Result<_, _>>()?),
            GgufValueType::String => {
                let what = format!("an element of `{key}`");
                GgufArray::String((0..n).map(|_| self.string(&what)).collect::<Result<_, _>>()?)
            }
            GgufValueType::Array => {
                GgufArray::Array((0..n).map(|_| self.array_value(key, depth + 1)).collect::<Result<_, _>>()?)
            }
        })
    }
}
