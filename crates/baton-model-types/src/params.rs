//! The parameters of a layer's math that a model's configuration names and the kernels take:
//! RoPE and the MLP's gate activation. Plain data, shared by the GGUF reader (which maps a
//! file's keys to them), the CPU kernels and the CUDA backend.

/// How RoPE frequencies are scaled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor`.
    Linear {
        /// Scale factor.
        factor: f32,
    },
    /// Llama 3's frequency-dependent scaling.
    Llama3 {
        /// Scale factor for low frequencies.
        factor: f32,
        /// Wavelength boundary (as a divisor of the original context) below which nothing scales.
        low_freq_factor: f32,
        /// Wavelength boundary above which everything scales.
        high_freq_factor: f32,
        /// Context length the model was trained at.
        original_max_position_embeddings: usize,
    },
}

/// The activation of the MLP's gate (the MLP is `down(act(gate(x)) * up(x))`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (SwiGLU): Llama, Qwen2.
    Silu,
    /// GELU with the tanh approximation (GeGLU): Gemma.
    GeluTanh,
}

/// Rotary position embedding parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeConfig {
    /// Base of the frequencies.
    pub theta: f32,
    /// Frequency scaling.
    pub scaling: RopeScaling,
}
