//! An open GGUF file: the parsed header over a memory map of the whole file, and tensor loading
//! into candle.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, QTensor, ggml_file::qtensor_from_ggml};
use candle_core::{Device, Tensor};

use crate::error::GgufError;
use crate::metadata::GgufMetadata;
use crate::reader::{GgufHeader, parse_header};
use crate::tensor::GgufTensorInfo;

/// Alignment every candle block type is happy with (`f32` fields are the widest).
const BLOCK_ALIGN: usize = 4;

enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Self::Mapped(m) => m,
            Self::Owned(v) => v,
        }
    }
}

/// A GGUF file, memory-mapped: metadata and tensor table parsed on open, tensor data read
/// from the map when a tensor is loaded.
///
/// ```no_run
/// use baton_gguf::GgufFile;
/// let gguf = GgufFile::open(std::path::Path::new(".models/gemma-3-270m-q4_k_m.gguf"))?;
/// let arch: &str = gguf.metadata().get("general.architecture")?;
/// let w = gguf.qtensor("blk.0.attn_q.weight", &candle_core::Device::Cpu)?;
/// println!("{arch}: {:?} {:?}", w.dtype(), w.shape());
/// # Ok::<(), baton_gguf::GgufError>(())
/// ```
pub struct GgufFile {
    path: PathBuf,
    bytes: Bytes,
    header: GgufHeader,
    by_name: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.header.version)
            .field("metadata_keys", &self.header.metadata.len())
            .field("tensors", &self.header.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Maps and parses a file.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let io = |source| GgufError::Io { path: path.to_owned(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only and lives as long as `self`. A GGUF file is not expected to
        // change while a model is loaded from it; if another process truncated it, reads could
        // fault, as they would for any mmap-based loader (llama.cpp, candle, safetensors).
        #[allow(unsafe_code)]
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Self::from_parts(path.to_owned(), Bytes::Mapped(map))
    }

    /// Parses a file already in memory; `name` is what errors call it.
    pub fn from_bytes(bytes: Vec<u8>, name: &Path) -> Result<Self, GgufError> {
        Self::from_parts(name.to_owned(), Bytes::Owned(bytes))
    }

    fn from_parts(path: PathBuf, bytes: Bytes) -> Result<Self, GgufError> {
        let header = parse_header(bytes.as_slice(), &path)?;
        let by_name = header.tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(Self { path, bytes, header, by_name })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.header.version
    }

    /// Alignment of the data section and each tensor.
    pub fn alignment(&self) -> u64 {
        self.header.alignment
    }

    /// Byte offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.header.data_offset
    }

    /// The metadata.
    pub fn metadata(&self) -> &GgufMetadata {
        &self.header.metadata
    }

    /// The tensor table, in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.header.tensors
    }

    /// Whether a tensor of that name exists.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// One tensor's table entry.
    pub fn tensor_info(&self, name: &str) -> Result<&GgufTensorInfo, GgufError> {
        self.by_name
            .get(name)
            .map(|&i| &self.header.tensors[i])
            .ok_or_else(|| GgufError::MissingTensor { path: self.path.clone(), name: name.to_owned() })
    }

    /// A tensor's raw bytes in the map, with its entry and candle type.
    pub fn tensor_data(&self, name: &str) -> Result<(&GgufTensorInfo, GgmlDType, &[u8]), GgufError> {
        let info = self.tensor_info(name)?;
        let fail = |reason: String| GgufError::Tensor { path: self.path.clone(), name: name.to_owned(), reason };
        let dtype = info
            .ggml_type
            .dtype()
            .ok_or_else(|| fail(format!("type {} is not supported by candle's quantized kernels", info.ggml_type)))?;
        let len = info.byte_len().ok_or_else(|| {
            fail(format!("shape {:?} does not fill whole {dtype:?} blocks of {}", info.shape, dtype.block_size()))
        })?;
        // `parse_header` checked the bounds of every tensor with a known type.
        let start = usize::try_from(self.header.data_offset + info.offset).map_err(|e| fail(e.to_string()))?;
        let bytes = self.bytes.as_slice().get(start..start + len).ok_or_else(|| fail("out of bounds".into()))?;
        Ok((info, dtype, bytes))
    }

    /// Loads a tensor as candle's quantized tensor (F32 and F16 tensors load as QTensors of
    /// those types). The data is copied out of the map.
    pub fn qtensor(&self, name: &str, device: &Device) -> Result<QTensor, GgufError> {
        let (info, dtype, bytes) = self.tensor_data(name)?;
        let fail = |e: candle_core::Error| GgufError::Tensor {
            path: self.path.clone(),
            name: name.to_owned(),
            reason: e.to_string(),
        };
        qtensor_from_bytes(dtype, bytes, info.shape.clone(), device).map_err(fail)
    }

    /// Loads a tensor dequantized to f32.
    pub fn tensor(&self, name: &str, device: &Device) -> Result<Tensor, GgufError> {
        self.qtensor(name, device)?.dequantize(device).map_err(|e| GgufError::Tensor {
            path: self.path.clone(),
            name: name.to_owned(),
            reason: e.to_string(),
        })
    }
}

/// A candle [`QTensor`] of `dtype` blocks from `bytes` (copied), whatever their alignment.
pub fn qtensor_from_bytes(
    dtype: GgmlDType,
    bytes: &[u8],
    shape: Vec<usize>,
    device: &Device,
) -> candle_core::Result<QTensor> {
    // candle reinterprets the bytes as blocks in place, which needs them aligned. Tensors in a
    // mapped file are (offsets are multiples of `general.alignment`); a buffer handed to
    // `from_bytes`, a row gathered elsewhere, or an odd alignment may not be: copy to an
    // aligned spot then.
    if bytes.as_ptr().align_offset(BLOCK_ALIGN) == 0 {
        qtensor_from_ggml(dtype, bytes, shape, device)
    } else {
        let mut buf = vec![0u8; bytes.len() + BLOCK_ALIGN];
        let pad = buf.as_ptr().align_offset(BLOCK_ALIGN);
        let aligned = &mut buf[pad..pad + bytes.len()];
        aligned.copy_from_slice(bytes);
        qtensor_from_ggml(dtype, aligned, shape, device)
    }
}
