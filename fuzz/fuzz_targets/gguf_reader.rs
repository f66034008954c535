//! The GGUF reader on any bytes a downloaded file could hold: the header, metadata and tensor
//! table must parse or be refused with an error, never panic or read out of bounds.
#![no_main]

use baton_gguf::{GgufHyperparams, parse_header};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(header) = parse_header(data, std::path::Path::new("fuzz.gguf")) {
        let _ = GgufHyperparams::from_metadata(&header.metadata);
    }
});
