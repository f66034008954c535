//! An open-addressing hash table keyed by values that already are well-mixed 64-bit hashes
//! (block hashes), mapping each to a nonzero 64-bit value: the pool's prefix index finds its
//! nodes by hash in one, and the conductor's global prompt trees (baton-sched) keep each
//! instance's blocks in one.
//!
//! Linear probing with backward-shift deletion (no tombstones), so a table that churns stays as
//! fast as a fresh one. A slot is 16 bytes, `[key, value]`, value 0 marking an empty slot, four
//! to a cache line: a probe that finds its key reads 1.5 slots on average (one line), and the
//! key's home slot is known before the probe, so a caller walking a prompt's blocks can
//! [`prefetch`](HashTable::prefetch) the slots of the blocks ahead of it and wait on several
//! cache misses at once. The load stays at most 3/4 (3/8 right after growing).
//!
//! Its slots live where [`Backing`] says: on the heap (the global allocator, which hands a
//! growing table memory others freed, already faulted in), or in an anonymous mapping advised
//! to use huge pages (a large table probed at random then misses the TLB far less).

use std::num::NonZeroU64;

/// Hints the CPU to bring the cache line at `p` closer; never faults, whatever the address.
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    // SAFETY: a prefetch is only a hint: it reads nothing architecturally and cannot fault.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Slots per 64-byte cache line. A mapping starts on a page, so its lines hold slots 4k to
/// 4k + 3; the heap aligns slots to 16 bytes only, so there [`HashTable::prefetch`]'s guess of
/// where a line ends may be off, and its second prefetch wasted (a hint, never wrong).
const SLOTS_PER_LINE: usize = 4;

/// The fewest slots a table has.
const MIN_SLOTS: usize = 16;

/// Where a [`HashTable`]'s slots live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backing {
    /// The global allocator. Memory that others freed is reused, while a fresh mapping's pages
    /// each cost a fault (zeroed and charged one by one) the first time they are written: the
    /// conductor's prompt trees grow from empty while it frees the updates it decoded, and
    /// faulting their tables in took longer than the inserts that filled them.
    #[default]
    Heap,
    /// An anonymous mapping advised to use huge pages: a large table probed at random misses
    /// the TLB far less (the pool's prefix index, sized once when the pool is made).
    HugePages,
}

/// A map from 64-bit keys that are already hashes to nonzero 64-bit values (see the module
/// docs). Any key may be stored, 0 included; keys that are not well mixed still spread
/// (Fibonacci hashing picks a key's home slot), but a peer choosing colliding keys on purpose
/// makes its own probes long.
#[derive(Debug)]
pub struct HashTable {
    slots: Slots,
    /// How many slots (a power of two).
    n: usize,
    /// `64 - log2(slots)`.
    shift: u32,
    len: usize,
}

/// The slots of a table, `[key, value]` each, as its [`Backing`] holds them.
#[derive(Debug)]
enum Slots {
    Heap(Vec<[u64; 2]>),
    Mapped(memmap2::MmapMut),
}

/// A slot of a [`HashTable`], as [`HashTable::probe`] found it: valid until the table changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot(usize);

/// Where a [`HashTable::probe`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// The key is in this slot, with this value.
    Found(Slot, NonZeroU64),
    /// The key is not in the table; this empty slot is where it would go
    /// ([`HashTable::fill`]).
    Vacant(Slot),
}

impl Clone for HashTable {
    fn clone(&self) -> Self {
        let slots = match &self.slots {
            Slots::Heap(v) => Slots::Heap(v.clone()),
            Slots::Mapped(m) => {
                let mut copy = memmap2::MmapMut::map_anon(m.len()).expect("memory for a hash table");
                copy.copy_from_slice(m);
                Slots::Mapped(copy)
            }
        };
        Self { slots, ..*self }
    }
}

impl Default for HashTable {
    fn default() -> Self {
        Self::new()
    }
}

impl HashTable {
    /// An empty table of the fewest slots.
    pub fn new() -> Self {
        Self::with_capacity(0)
    }

    /// An empty table on the heap that holds `n` keys before it grows.
    pub fn with_capacity(n: usize) -> Self {
        Self::with_capacity_in(n, Backing::Heap)
    }

    /// An empty table that holds `n` keys before it grows, its slots (and those of the tables
    /// it grows into) where `backing` says.
    pub fn with_capacity_in(n: usize, backing: Backing) -> Self {
        Self::with_slots(Self::slots_for(n), backing)
    }

    /// Where the slots live.
    pub fn backing(&self) -> Backing {
        match self.slots {
            Slots::Heap(_) => Backing::Heap,
            Slots::Mapped(_) => Backing::HugePages,
        }
    }

    /// The slots a table holding `n` keys needs: a power of two.
    fn slots_for(n: usize) -> usize {
        (n.saturating_mul(4) / 3 + 1).next_power_of_two().max(MIN_SLOTS)
    }

    fn with_slots(n: usize, backing: Backing) -> Self {
        let slots = match backing {
            Backing::Heap => Slots::Heap(vec![[0; 2]; n]),
            Backing::HugePages => {
                let map = memmap2::MmapMut::map_anon(n * 16).expect("memory for a hash table");
                // Only advice: without huge pages the table works the same, with more TLB misses.
                #[cfg(target_os = "linux")]
                let _ = map.advise(memmap2::Advice::HugePage);
                Slots::Mapped(map)
            }
        };
        Self { slots, n, shift: 64 - n.trailing_zeros(), len: 0 }
    }

    /// Keys in the table.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the table holds no key.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keys the table holds before it grows.
    pub fn capacity(&self) -> usize {
        self.n * 3 / 4
    }

    #[inline]
    fn slots(&self) -> &[[u64; 2]] {
        match &self.slots {
            Slots::Heap(v) => v,
            Slots::Mapped(m) => bytemuck::cast_slice(m),
        }
    }

    #[inline]
    fn slots_mut(&mut self) -> &mut [[u64; 2]] {
        match &mut self.slots {
            Slots::Heap(v) => v,
            Slots::Mapped(m) => bytemuck::cast_slice_mut(m),
        }
    }

    #[inline]
    fn mask(&self) -> usize {
        self.n - 1
    }

    /// The home slot of `key` (Fibonacci hashing: robust even to poorly mixed keys).
    #[inline]
    fn home(&self, key: u64) -> usize {
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    /// Starts loading the cache line holding `key`'s home slot and, with `to_miss` unless the
    /// home slot starts its line, the next line too: a probe for a missing key reads past its
    /// home slot (2.5 slots on average at half load), and a run crossing into an unfetched line
    /// costs a full miss. A probe that finds its key reads 1.5 slots on average: one line.
    #[inline]
    pub fn prefetch(&self, key: u64, to_miss: bool) {
        let slots = self.slots();
        let i = self.home(key);
        prefetch(&slots[i]);
        if to_miss && !i.is_multiple_of(SLOTS_PER_LINE) {
            prefetch(&slots[(i + SLOTS_PER_LINE - 1) & (slots.len() - 1)]);
        }
    }

    /// Finds `key`: its slot and value, or the empty slot where it would go.
    #[inline]
    pub fn probe(&self, key: u64) -> Probe {
        let slots = self.slots();
        let mask = slots.len() - 1;
        let mut i = self.home(key);
        loop {
            let [k, v] = slots[i];
            let Some(value) = NonZeroU64::new(v) else { return Probe::Vacant(Slot(i)) };
            if k == key {
                return Probe::Found(Slot(i), value);
            }
            i = (i + 1) & mask;
        }
    }

    /// The value of `key`.
    #[inline]
    pub fn get(&self, key: u64) -> Option<NonZeroU64> {
        match self.probe(key) {
            Probe::Found(_, value) => Some(value),
            Probe::Vacant(_) => None,
        }
    }

    /// Whether one more key would push the load past 3/4: [`fill`](Self::fill) needs room.
    #[inline]
    pub fn full(&self) -> bool {
        (self.len + 1) * 4 > self.n * 3
    }

    /// Puts `key` in the vacant slot `at` that a [`probe`](Self::probe) for it just returned,
    /// the table unchanged since and not [`full`](Self::full): an insert without a second probe.
    #[inline]
    pub fn fill(&mut self, at: Slot, key: u64, value: NonZeroU64) {
        debug_assert!(self.slots()[at.0][1] == 0 && !self.full());
        self.slots_mut()[at.0] = [key, value.get()];
        self.len += 1;
    }

    /// Replaces the value in the slot `at` that a [`probe`](Self::probe) just found, the table
    /// unchanged since.
    #[inline]
    pub fn set(&mut self, at: Slot, value: NonZeroU64) {
        debug_assert!(self.slots()[at.0][1] != 0);
        self.slots_mut()[at.0][1] = value.get();
    }

    /// Maps `key` to `value`, growing the table first when needed; returns the value it had.
    pub fn insert(&mut self, key: u64, value: NonZeroU64) -> Option<NonZeroU64> {
        if self.full() {
            self.grow(self.n * 2);
        }
        match self.probe(key) {
            Probe::Found(at, old) => {
                self.set(at, value);
                Some(old)
            }
            Probe::Vacant(at) => {
                self.fill(at, key, value);
                None
            }
        }
    }

    /// Makes room for `additional` more keys without growing.
    pub fn reserve(&mut self, additional: usize) {
        let want = self.len.saturating_add(additional);
        if want > self.capacity() {
            self.grow(Self::slots_for(want));
        }
    }

    /// Moves every key into a table of `slots` slots (a power of two, more than the keys need),
    /// in slot order: each lands near twice its old position, so both tables are read and
    /// written front to back.
    fn grow(&mut self, slots: usize) {
        let old = std::mem::replace(self, Self::with_slots(slots, self.backing()));
        for &[key, value] in old.slots() {
            if let Some(value) = NonZeroU64::new(value) {
                match self.probe(key) {
                    Probe::Vacant(at) => self.fill(at, key, value),
                    Probe::Found(..) => unreachable!("keys are unique"),
                }
            }
        }
    }

    /// Removes `key`, shifting later keys of its run back; returns its value.
    pub fn remove(&mut self, key: u64) -> Option<NonZeroU64> {
        let Probe::Found(Slot(mut i), value) = self.probe(key) else { return None };
        let mask = self.mask();
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let e = self.slots()[j];
            if e[1] == 0 {
                break;
            }
            // The key at `j` may fill the hole at `i` unless its home lies cyclically in (i, j].
            let k = self.home(e[0]);
            let stays = if i <= j { i < k && k <= j } else { i < k || k <= j };
            if !stays {
                self.slots_mut()[i] = e;
                i = j;
            }
        }
        self.slots_mut()[i] = [0, 0];
        self.len -= 1;
        Some(value)
    }

    /// Every key with its value, in slot order (which depends on the keys and the table's
    /// history, not on the order of inserts alone).
    pub fn iter(&self) -> impl Iterator<Item = (u64, NonZeroU64)> + '_ {
        self.slots().iter().filter_map(|&[key, value]| Some((key, NonZeroU64::new(value)?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nz(v: u64) -> NonZeroU64 {
        NonZeroU64::new(v).expect("nonzero")
    }

    /// Random inserts, overwrites, removals and lookups against `std`'s map as the model,
    /// with few distinct keys (some tiny, so runs collide and wrap around the table's end)
    /// through many growths, on either backing.
    #[test]
    fn agrees_with_a_hash_map_through_inserts_removes_and_growth() {
        for backing in [Backing::Heap, Backing::HugePages] {
            agrees_with_a_hash_map(backing);
        }
    }

    fn agrees_with_a_hash_map(backing: Backing) {
        let mut t = HashTable::with_capacity_in(4, backing);
        let mut m = std::collections::HashMap::new();
        let mut x = 0x1234_5678_u64;
        for step in 1..=40_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = if step % 3 == 0 { x % 64 } else { x % 4096 };
            match x >> 62 {
                0 => assert_eq!(t.remove(key), m.remove(&key).map(nz), "remove {key}"),
                1 => assert_eq!(t.insert(key, nz(step)), m.insert(key, step).map(nz), "insert {key}"),
                2 => match t.probe(key) {
                    Probe::Found(at, v) => {
                        assert_eq!(m.insert(key, step), Some(v.get()));
                        t.set(at, nz(step));
                    }
                    Probe::Vacant(at) => {
                        assert_eq!(m.insert(key, step), None);
                        if t.full() {
                            t.insert(key, nz(step));
                        } else {
                            t.fill(at, key, nz(step));
                        }
                    }
                },
                _ => assert_eq!(t.get(key), m.get(&key).copied().map(nz), "get {key}"),
            }
            assert_eq!(t.len(), m.len());
            if step % 997 == 0 {
                for k in 0..4096 {
                    assert_eq!(t.get(k), m.get(&k).copied().map(nz), "key {k} at step {step}");
                }
                let mut listed: Vec<(u64, u64)> = t.iter().map(|(k, v)| (k, v.get())).collect();
                listed.sort_unstable();
                let mut model: Vec<(u64, u64)> = m.iter().map(|(&k, &v)| (k, v)).collect();
                model.sort_unstable();
                assert_eq!(listed, model);
            }
        }
        assert_eq!(t.backing(), backing, "growth keeps the backing");
    }

    #[test]
    fn reserve_makes_room_without_growing_later() {
        let mut t = HashTable::new();
        assert_eq!(t.backing(), Backing::Heap);
        t.insert(7, nz(1));
        t.reserve(10_000);
        assert!(t.capacity() >= 10_001);
        let slots = t.n;
        for k in 0..10_000u64 {
            t.insert(k.wrapping_mul(0x9E37_79B9_7F4A_7C15), nz(k + 1));
        }
        assert_eq!(t.n, slots, "no growth after the reservation");
        assert_eq!(t.len(), 10_001);
        assert_eq!(t.get(7), Some(nz(1)));
        let copy = t.clone();
        assert_eq!(copy.len(), t.len());
        assert!(copy.iter().eq(t.iter()));
        let mut gone = copy.clone();
        for k in 0..10_000u64 {
            assert_eq!(gone.remove(k.wrapping_mul(0x9E37_79B9_7F4A_7C15)), Some(nz(k + 1)));
        }
        assert_eq!(gone.iter().collect::<Vec<_>>(), vec![(7, nz(1))]);
    }
}
