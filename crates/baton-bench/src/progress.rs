//! A progress bar on stderr while a benchmark runs (hidden when stderr is not a terminal).

use std::sync::Mutex;

use indicatif::{ProgressBar, ProgressStyle};

use crate::metrics::RequestRecord;
use crate::runner::Observer;

/// Shows one bar per run: requests done, failures, elapsed time.
#[derive(Debug, Default)]
pub struct ProgressBars {
    bar: Mutex<Option<(ProgressBar, u64)>>,
}

impl ProgressBars {
    /// No bar until a run starts.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Observer for ProgressBars {
    fn run_started(&self, label: &str, requests: usize) {
        let bar = ProgressBar::new(requests as u64);
        let style = ProgressStyle::with_template("{prefix:>16} [{elapsed_precise}] {wide_bar} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        bar.set_prefix(label.to_owned());
        if let Ok(mut b) = self.bar.lock() {
            *b = Some((bar, 0));
        }
    }

    fn request_done(&self, record: &RequestRecord) {
        if let Ok(mut b) = self.bar.lock()
            && let Some((bar, failed)) = b.as_mut()
        {
            if !record.ok() {
                *failed += 1;
                bar.set_message(format!("{failed} failed"));
            }
            bar.inc(1);
        }
    }

    fn run_finished(&self) {
        if let Ok(mut b) = self.bar.lock()
            && let Some((bar, _)) = b.take()
        {
            bar.finish();
        }
    }
}
