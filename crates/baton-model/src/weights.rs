//! Where weights come from: safetensors files (single or sharded) or a seeded random source.
//!
//! The model asks a [`WeightSource`] for tensors by Hugging Face name and gets float32 candle
//! tensors, whatever the dtype on disk.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use memmap2::Mmap;
use rand::{Rng, SeedableRng, rngs::StdRng};
use safetensors::{Dtype, SafeTensors};

pub use baton_model_types::WeightSource;

use crate::config::read_json;
use crate::error::{ModelError, Result};

/// [`RandomWeights`] a device backend makes on the device ([`WeightSource::device_random`]):
/// a benchmark's 8B-shaped model without 32 GB of host floats. On the CPU, the same as the
/// wrapped source.
#[derive(Debug, Clone)]
pub struct DeviceRandomWeights(pub RandomWeights);

impl WeightSource for DeviceRandomWeights {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.0.tensor(name, shape)
    }

    fn contains(&self, name: &str) -> bool {
        self.0.contains(name)
    }

    fn device_random(&self) -> Option<(u64, f32)> {
        Some((self.0.seed, self.0.std))
    }
}

/// Tensors in `model.safetensors`, or in the shards a `model.safetensors.index.json` lists,
/// memory-mapped.
pub struct SafetensorsWeights {
    files: Vec<(PathBuf, Mmap)>,
    /// Tensor name → index into `files`.
    index: HashMap<String, usize>,
}

impl SafetensorsWeights {
    /// Opens the weights of a checkpoint directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        if single.exists() {
            return Self::from_files(&[single]);
        }
        if !index_path.exists() {
            return Err(ModelError::Io {
                path: single,
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no model.safetensors and no model.safetensors.index.json",
                ),
            });
        }
        let index = read_json(&index_path)?;
        let map = index
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ModelError::MissingField { path: index_path.clone(), field: "weight_map".into() })?;
        let mut shards: Vec<String> = Vec::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| ModelError::InvalidField {
                path: index_path.clone(),
                field: format!("weight_map.{name}"),
                reason: "must be a file name".into(),
            })?;
            if !shards.iter().any(|s| s == file) {
                shards.push(file.to_owned());
            }
        }
        let paths: Vec<PathBuf> = shards.iter().map(|s| dir.join(s)).collect();
        Self::from_files(&paths)
    }

    /// Opens a list of safetensors files; a tensor name may appear in one of them only.
    pub fn from_files(paths: &[PathBuf]) -> Result<Self> {
        let mut files = Vec::with_capacity(paths.len());
        let mut index = HashMap::new();
        for (i, path) in paths.iter().enumerate() {
            let file = File::open(path).map_err(|source| ModelError::Io { path: path.clone(), source })?;
            let mmap = map_file(&file).map_err(|source| ModelError::Io { path: path.clone(), source })?;
            let st = SafeTensors::deserialize(&mmap)
                .map_err(|e| ModelError::BadWeights { path: path.clone(), reason: e.to_string() })?;
            for name in st.names() {
                if index.insert(name.to_owned(), i).is_some() {
                    return Err(ModelError::BadWeights {
                        path: path.clone(),
                        reason: format!("tensor `{name}` appears in more than one shard"),
                    });
                }
            }
            files.push((path.clone(), mmap));
        }
        Ok(Self { files, index })
    }

    fn location(&self) -> String {
        self.files.iter().map(|(p, _)| p.display().to_string()).collect::<Vec<_>>().join(", ")
    }
}

#[allow(unsafe_code)]
fn map_file(file: &File) -> std::io::Result<Mmap> {
    // SAFETY: the map is read-only and checkpoint files are not modified while a model is
    // loaded; a concurrent writer could only change weight values, not memory safety of Rust
    // data structures built from copies of them.
    unsafe { Mmap::map(file) }
}

impl WeightSource for SafetensorsWeights {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let &i = self
            .index
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor { name: name.into(), location: self.location() })?;
        let (path, mmap) = &self.files[i];
        let bad = |reason: String| ModelError::BadWeights { path: path.clone(), reason };
        let st = SafeTensors::deserialize(mmap).map_err(|e| bad(e.to_string()))?;
        let view = st.tensor(name).map_err(|e| bad(format!("tensor `{name}`: {e}")))?;
        if view.shape() != shape {
            return Err(ModelError::ShapeMismatch {
                name: name.into(),
                path: path.clone(),
                expected: shape.to_vec(),
                actual: view.shape().to_vec(),
            });
        }
        let bytes = view.data();
        let values: Vec<f32> = match view.dtype() {
            Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::BF16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            other => return Err(bad(format!("tensor `{name}` has dtype {other:?}; expected F32, F16 or BF16"))),
        };
        Ok(Tensor::from_vec(values, shape, &Device::Cpu)?)
    }

    fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }
}

/// Random weights for benchmarks and tests of shape: normal-ish values with standard deviation
/// `std` (norm weights are ones, biases zeros), the same for the same seed and name.
#[derive(Debug, Clone)]
pub struct RandomWeights {
    /// Seed mixed with each tensor's name.
    pub seed: u64,
    /// Standard deviation of matrix entries.
    pub std: f32,
}

impl WeightSource for RandomWeights {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let values = if name.contains("norm") {
            vec![1.0; n]
        } else if name.ends_with("bias") {
            vec![0.0; n]
        } else {
            let seed = name
                .bytes()
                .fold(self.seed ^ 0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
            let mut rng = StdRng::seed_from_u64(seed);
            // A sum of uniforms: cheap, bounded, close enough to normal for shape tests.
            let scale = self.std * 2.0;
            (0..n).map(|_| (rng.random::<f32>() + rng.random::<f32>() - 1.0) * scale).collect()
        };
        Ok(Tensor::from_vec(values, shape, &Device::Cpu)?)
    }

    fn contains(&self, name: &str) -> bool {
        !name.ends_with("bias")
    }
}
