//! The binary state stream a worker sends the conductor (`baton_protocol::state_codec`): any
//! bytes, as one frame and as a stream cut into chunks, decode to updates or an error, never a
//! panic or an allocation the header alone asked for; and an update that decodes encodes back
//! to bytes that decode to the same update.
#![no_main]

use baton_protocol::state_codec::{self, StateFormat, StateReader};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(update) = state_codec::decode(data) {
        let mut again = Vec::new();
        state_codec::encode(&update, &mut again).expect("a decoded update encodes");
        let back = state_codec::decode(&again).expect("an encoded update decodes");
        assert_eq!(format!("{back:?}"), format!("{update:?}"), "a round trip changed the update");
    }
    // The same bytes as a stream, in chunks whose sizes the first byte sets.
    let chunk = usize::from(data.first().copied().unwrap_or(1)).max(1);
    for format in [StateFormat::Binary, StateFormat::Ndjson] {
        let mut reader = StateReader::new(format);
        'stream: for piece in data.chunks(chunk) {
            reader.extend(piece);
            loop {
                match reader.next_update() {
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(_) => break 'stream,
                }
            }
        }
    }
});
