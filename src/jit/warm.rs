//! Filling the disk cache ahead of time: many (spec, target) pairs compiled in parallel on
//! scoped threads. `kiln warm` is this plus kiln's registered specs; an application warms its
//! own specs (and kiln's, if it likes) with one call.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use super::compiler::{Jit, Origin};
use super::spec::KernelSpec;
use super::target::Target;

/// One finished item, for a progress callback.
#[derive(Clone, Copy, Debug)]
pub struct WarmProgress<'a> {
    pub spec: &'a KernelSpec,
    pub target: Target,
    /// Where the module came from, or None when it failed.
    pub origin: Option<Origin>,
    /// Items finished so far (this one included) and in all.
    pub done: usize,
    pub total: usize,
}

/// What a warm did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct WarmReport {
    pub specs: usize,
    /// Compiled by NVRTC now.
    pub compiled: usize,
    /// Found on disk (or already in this process's memory).
    pub cached: usize,
    /// "spec on target: error", one per failure, in no particular order.
    pub failures: Vec<String>,
    pub jobs: usize,
    pub seconds: f64,
}

impl Jit {
    /// Compiles (or finds) every `(spec, target)` of `work` on `jobs` threads (0: one per CPU),
    /// calling `progress` after each item, from the worker that finished it. Failures are
    /// collected, never fatal: the report says what failed and why.
    pub fn warm(
        &self,
        work: &[(KernelSpec, Target)],
        jobs: usize,
        progress: &(dyn Fn(&WarmProgress) + Sync),
    ) -> WarmReport {
        let started = Instant::now();
        let jobs = if jobs == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            jobs
        }
        .clamp(1, 256);
        let next = AtomicUsize::new(0);
        let done = AtomicUsize::new(0);
        let (compiled, cached) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let failures = Mutex::new(Vec::new());
        std::thread::scope(|scope| {
            for _ in 0..jobs.min(work.len()) {
                scope.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((spec, target)) = work.get(i) else {
                        break;
                    };
                    let origin = match self.compile(spec, *target) {
                        Ok(c) => {
                            let counter = if c.origin == Origin::Compiled {
                                &compiled
                            } else {
                                &cached
                            };
                            counter.fetch_add(1, Ordering::Relaxed);
                            Some(c.origin)
                        }
                        Err(e) => {
                            failures
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push(format!("{spec} on {target}: {e}"));
                            None
                        }
                    };
                    progress(&WarmProgress {
                        spec,
                        target: *target,
                        origin,
                        done: done.fetch_add(1, Ordering::Relaxed) + 1,
                        total: work.len(),
                    });
                });
            }
        });
        WarmReport {
            specs: work.len(),
            compiled: compiled.into_inner(),
            cached: cached.into_inner(),
            failures: failures.into_inner().unwrap_or_else(|e| e.into_inner()),
            jobs,
            seconds: started.elapsed().as_secs_f64(),
        }
    }
}
