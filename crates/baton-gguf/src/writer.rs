//! Writing GGUF v3 files: small ones for tests, or a tool that re-packs a model.

use candle_core::quantized::QTensor;

use crate::reader::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC};
use crate::tensor::GgmlTypeId;
use crate::value::{GgufArray, GgufValue};

/// Builds a GGUF v3 file in memory.
///
/// ```
/// use baton_gguf::{GgufFile, GgufValue, GgufWriter};
/// let mut w = GgufWriter::new();
/// w.add_metadata("general.architecture", GgufValue::String("llama".into()));
/// let f = GgufFile::from_bytes(w.to_bytes(), "mem.gguf".as_ref())?;
/// assert_eq!(f.metadata().get::<&str>("general.architecture")?, "llama");
/// # Ok::<(), baton_gguf::GgufError>(())
/// ```
#[derive(Debug, Clone)]
pub struct GgufWriter {
    alignment: u64,
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<PendingTensor>,
}

#[derive(Debug, Clone)]
struct PendingTensor {
    name: String,
    shape: Vec<usize>,
    ggml_type: GgmlTypeId,
    data: Vec<u8>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// An empty file with the default alignment (32).
    pub fn new() -> Self {
        Self { alignment: DEFAULT_ALIGNMENT, metadata: Vec::new(), tensors: Vec::new() }
    }

    /// Sets the alignment (a power of two) and records it as `general.alignment`.
    pub fn set_alignment(&mut self, alignment: u32) {
        self.alignment = u64::from(alignment);
        self.metadata.retain(|(k, _)| k != ALIGNMENT_KEY);
        self.metadata.push((ALIGNMENT_KEY.to_owned(), GgufValue::U32(alignment)));
    }

    /// Appends a metadata entry.
    pub fn add_metadata(&mut self, key: impl Into<String>, value: GgufValue) {
        self.metadata.push((key.into(), value));
    }

    /// Appends a tensor from raw ggml bytes; `shape` is outermost first, as candle writes it.
    pub fn add_raw_tensor(&mut self, name: impl Into<String>, shape: &[usize], ggml_type: GgmlTypeId, data: Vec<u8>) {
        self.tensors.push(PendingTensor { name: name.into(), shape: shape.to_vec(), ggml_type, data });
    }

    /// Appends a candle quantized tensor.
    pub fn add_qtensor(&mut self, name: impl Into<String>, tensor: &QTensor) -> candle_core::Result<()> {
        let data = tensor.data()?.into_owned();
        self.add_raw_tensor(name, tensor.shape().dims(), GgmlTypeId::from_dtype(tensor.dtype()), data);
        Ok(())
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let align = |n: usize| n.div_ceil(self.alignment as usize) * self.alignment as usize;
        let mut out = Vec::new();
        out.extend_from_slice(&GGUF_MAGIC);
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            write_string(&mut out, key);
            out.extend_from_slice(&value.value_type().id().to_le_bytes());
            write_value(&mut out, value);
        }
        let mut offset = 0usize;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            write_string(&mut out, &t.name);
            out.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
            for &d in t.shape.iter().rev() {
                out.extend_from_slice(&(d as u64).to_le_bytes());
            }
            out.extend_from_slice(&t.ggml_type.0.to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = align(offset + t.data.len());
        }
        let data_start = align(out.len());
        out.resize(data_start, 0);
        for (t, off) in self.tensors.iter().zip(offsets) {
            out.resize(data_start + off, 0);
            out.extend_from_slice(&t.data);
        }
        out.resize(data_start + offset, 0);
        out
    }
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write_value(out: &mut Vec<u8>, value: &GgufValue) {
    match value {
        GgufValue::U8(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        GgufValue::Bool(v) => out.push(u8::from(*v)),
        GgufValue::String(s) => write_string(out, s),
        GgufValue::Array(a) => write_array(out, a),
    }
}

fn write_array(out: &mut Vec<u8>, a: &GgufArray) {
    out.extend_from_slice(&a.element_type().id().to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! each {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        GgufArray::U8(v) => each!(v),
        GgufArray::I8(v) => each!(v),
        GgufArray::U16(v) => each!(v),
        GgufArray::I16(v) => each!(v),
        GgufArray::U32(v) => each!(v),
        GgufArray::I32(v) => each!(v),
        GgufArray::U64(v) => each!(v),
        GgufArray::I64(v) => each!(v),
        GgufArray::F32(v) => each!(v),
        GgufArray::F64(v) => each!(v),
        GgufArray::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        GgufArray::String(v) => v.iter().for_each(|s| write_string(out, s)),
        GgufArray::Array(v) => v.iter().for_each(|x| write_array(out, x)),
    }
}
