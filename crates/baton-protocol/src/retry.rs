//! Waits between retries: exponential back-off with jitter, so that the peers of a registry or a
//! worker that comes back are not all retried in the same instant.

use std::time::Duration;

use backon::BackoffBuilder;

/// Waits starting at `first`, doubling up to `max`, each with a random jitter of up to itself
/// added (so in `[d, 2d)`); endless.
pub fn backoff(first: Duration, max: Duration) -> impl Iterator<Item = Duration> + Send {
    backon::ExponentialBuilder::new()
        .with_min_delay(first)
        .with_max_delay(max)
        .with_jitter()
        .without_max_times()
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_to_their_cap_with_jitter_and_never_end() {
        let (first, max) = (Duration::from_millis(100), Duration::from_secs(1));
        let waits: Vec<Duration> = backoff(first, max).take(50).collect();
        assert_eq!(waits.len(), 50, "endless");
        assert!(waits.iter().all(|w| *w >= first && *w < 2 * max), "{waits:?}");
        assert!(waits[0] < 2 * first, "the first wait is about `first`: {:?}", waits[0]);
        assert!(waits[49] >= max, "capped at `max` (plus jitter): {:?}", waits[49]);
        let distinct: std::collections::HashSet<_> = waits[10..].iter().collect();
        assert!(distinct.len() > 30, "jittered: {} distinct waits at the cap", distinct.len());
    }
}
