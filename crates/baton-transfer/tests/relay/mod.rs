//! A TCP relay that damages KV on the wire, for the tests of checksums on the transfer plane
//! (this crate's `tests/corrupt.rs`, and the `baton` cluster tests through `#[path]`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// A relay listening on `from` (port 0 picks one; the address is returned) to `to`: it
/// forwards everything both ways, and while `flip` is set inverts the byte in the middle of
/// each payload coming back from `to` (KV transfer frames, parsed: 24-byte headers with the
/// metadata's length at 8 and the payload's at 16). What clients send passes as it is.
pub(crate) fn flipping_relay(from: SocketAddr, to: SocketAddr, flip: Arc<AtomicBool>) -> SocketAddr {
    let listener = TcpListener::bind(from).expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let Ok(upstream) = TcpStream::connect(to) else { continue };
            let (mut c_in, mut u_out) = (client.try_clone().expect("clone"), upstream.try_clone().expect("clone"));
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut c_in, &mut u_out);
                let _ = u_out.shutdown(std::net::Shutdown::Write);
            });
            let flip = Arc::clone(&flip);
            std::thread::spawn(move || {
                let (mut u_in, mut c_out) = (upstream, client);
                let _ = relay_frames(&mut u_in, &mut c_out, &flip);
                let _ = c_out.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    addr
}

fn relay_frames(from: &mut TcpStream, to: &mut TcpStream, flip: &AtomicBool) -> std::io::Result<()> {
    loop {
        let mut h = [0u8; 24];
        from.read_exact(&mut h)?;
        let meta_len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
        let mut payload_len = [0u8; 8];
        payload_len.copy_from_slice(&h[16..24]);
        let payload_len = u64::from_le_bytes(payload_len) as usize;
        let mut body = vec![0u8; meta_len + payload_len];
        from.read_exact(&mut body)?;
        if payload_len > 0 && flip.load(Ordering::Relaxed) {
            body[meta_len + payload_len / 2] ^= 0xFF;
        }
        to.write_all(&h)?;
        to.write_all(&body)?;
    }
}
