//! The KV transfer protocol's frame decoder, fed what a hostile peer could send: a header, then
//! as much metadata as it declares. Decoding must refuse or accept, never panic or allocate
//! what the header merely claims.
#![no_main]

use baton_transfer::frame::{Frame, HEADER_LEN, Header};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((head, rest)) = data.split_first_chunk::<HEADER_LEN>() else { return };
    let Ok(header) = Header::decode(head) else { return };
    let meta = &rest[..header.meta_len.min(rest.len())];
    if let Ok(frame) = Frame::decode(&header, meta) {
        // What decodes must encode again.
        let _ = frame.encode();
    }
});
