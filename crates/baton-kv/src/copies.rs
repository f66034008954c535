//! Bytes moved into and out of an instance's device arena, by direction: what a worker reports
//! and `/metrics` exports as `baton_kv_copy_bytes_total{direction}`.
//!
//! One [`CopyMeter`] per instance, shared by everything that moves its device arena's bytes:
//! the pool's tier copies (a block demoted to the host or disk tier leaves the device, one
//! swapped in arrives), the device backend (what it copies between its memory and the host on
//! its own account), and the transfer plane (bytes sent from the arena to a peer, received into
//! it, copied device to device). The forward pass itself reads and writes the arena in place
//! and counts nothing: a step that moves bytes to the host is what the meter exists to show.

use std::sync::atomic::{AtomicU64, Ordering};

/// Which way bytes moved, seen from the device arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CopyDirection {
    /// Out of the device arena into host memory (a demotion, a send, a backend's write-back).
    DeviceToHost,
    /// From host memory into the device arena (a swap-in, a receive, a backend's upload).
    HostToDevice,
    /// Between two device arenas (a same-host hand-off over a device link).
    DeviceToDevice,
}

impl CopyDirection {
    /// Every direction, in the order [`CopyBytes`] lists them.
    pub const ALL: [CopyDirection; 3] = [Self::DeviceToHost, Self::HostToDevice, Self::DeviceToDevice];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::DeviceToHost => "device_to_host",
            Self::HostToDevice => "host_to_device",
            Self::DeviceToDevice => "device_to_device",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for CopyDirection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

/// Counters of bytes copied, by direction, since the meter was made (see the module docs).
/// Shared behind an `Arc`; counting is one relaxed add.
#[derive(Debug, Default)]
pub struct CopyMeter {
    bytes: [AtomicU64; 3],
}

impl CopyMeter {
    /// Counts `bytes` moved `direction`.
    pub fn add(&self, direction: CopyDirection, bytes: u64) {
        self.bytes[direction.index()].fetch_add(bytes, Ordering::Relaxed);
    }

    /// Bytes moved `direction` so far.
    pub fn get(&self, direction: CopyDirection) -> u64 {
        self.bytes[direction.index()].load(Ordering::Relaxed)
    }

    /// Every counter at once.
    pub fn snapshot(&self) -> CopyBytes {
        CopyBytes {
            device_to_host: self.get(CopyDirection::DeviceToHost),
            host_to_device: self.get(CopyDirection::HostToDevice),
            device_to_device: self.get(CopyDirection::DeviceToDevice),
        }
    }
}

/// A [`CopyMeter`]'s counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopyBytes {
    /// Bytes out of the device arena into host memory.
    pub device_to_host: u64,
    /// Bytes from host memory into the device arena.
    pub host_to_device: u64,
    /// Bytes between device arenas.
    pub device_to_device: u64,
}

impl CopyBytes {
    /// The counter of `direction`.
    pub fn get(&self, direction: CopyDirection) -> u64 {
        match direction {
            CopyDirection::DeviceToHost => self.device_to_host,
            CopyDirection::HostToDevice => self.host_to_device,
            CopyDirection::DeviceToDevice => self.device_to_device,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_meter_counts_each_direction_apart() {
        let m = CopyMeter::default();
        m.add(CopyDirection::DeviceToHost, 10);
        m.add(CopyDirection::HostToDevice, 3);
        m.add(CopyDirection::DeviceToHost, 5);
        let s = m.snapshot();
        assert_eq!((s.device_to_host, s.host_to_device, s.device_to_device), (15, 3, 0));
        assert!(CopyDirection::ALL.iter().all(|&d| s.get(d) == m.get(d)));
        assert_eq!(
            CopyDirection::ALL.map(CopyDirection::label),
            ["device_to_host", "host_to_device", "device_to_device"]
        );
    }
}
