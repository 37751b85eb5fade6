//! Filling the disk cache ahead of time: many (spec, target) pairs compiled in parallel on
//! scoped threads. `kiln warm` is this plus kiln's registered specs; an application warms its
//! own specs (and kiln's, if it likes) with one call.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use super::compiler::{Compiled, Jit, Origin, PRODUCER};
use super::disk_cache::Lookup;
use super::entry::Entry;
use super::spec::KernelSpec;
use super::target::{Target, TargetKind};
use crate::error::Result;

/// One finished item, for a progress callback.
#[derive(Clone, Copy, Debug)]
pub struct WarmProgress<'a> {
    /// The spec's description (or, for a recompiled cache entry, the one it was made from).
    pub what: &'a str,
    /// The target asked for.
    pub target: Target,
    /// Where the module came from, or None when it failed.
    pub origin: Option<Origin>,
    /// Items finished so far (this one included) and in all.
    pub done: usize,
    /// Items in the whole warm.
    pub total: usize,
}

/// What a warm did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct WarmReport {
    /// Items asked for: (spec, target) pairs, or (cache entry, target) pairs.
    pub specs: usize,
    /// Compiled by NVRTC now.
    pub compiled: usize,
    /// Found on disk (or already in this process's memory).
    pub cached: usize,
    /// "spec on target: error", one per failure, in no particular order.
    pub failures: Vec<String>,
    /// Worker threads the warm could use (one per CPU when asked for 0; at most 256).
    pub jobs: usize,
    /// Wall-clock time the warm took.
    pub seconds: f64,
}

impl WarmReport {
    /// Adds another warm's counts to this one, for warms run one after the other: the larger
    /// number of jobs, the two times added.
    pub fn absorb(&mut self, other: WarmReport) {
        self.specs += other.specs;
        self.compiled += other.compiled;
        self.cached += other.cached;
        self.failures.extend(other.failures);
        self.jobs = self.jobs.max(other.jobs);
        self.seconds += other.seconds;
    }
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
        run(
            work,
            jobs,
            |(spec, target)| (spec.to_string(), *target, self.compile(spec, *target)),
            progress,
        )
    }

    /// Compiles, for each of `targets`, every module this cache holds for another target, from
    /// the source, options and entry points the entry records (see [`Jit::compile_entry_for`]):
    /// a build machine serves a new GPU type without the application whose kernels they are.
    /// Entries another kiln version wrote are left out (their templates are not this
    /// version's); so are those written for one architecture's own features (`sm_90a`), on
    /// any other architecture.
    pub fn warm_from_cache(
        &self,
        targets: &[Target],
        jobs: usize,
        progress: &(dyn Fn(&WarmProgress) + Sync),
    ) -> WarmReport {
        let work: Vec<(Entry, Target)> = self
            .cached_recipes()
            .into_iter()
            .flat_map(|e| targets.iter().map(move |&t| (e.clone(), t)))
            .filter(|(e, t)| recipe_builds_for(e, *t))
            .collect();
        run(
            &work,
            jobs,
            |(entry, target)| {
                let result = self.compile_entry_for(entry, *target);
                (entry.spec.clone(), *target, result)
            },
            progress,
        )
    }

    /// One entry per distinct module this kiln version wrote (source, options, entry points),
    /// whatever its target and NVRTC.
    fn cached_recipes(&self) -> Vec<Entry> {
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::new();
        for file in self.disk_cache().entry_files() {
            let Some(key) = file.key else { continue };
            let Lookup::Hit(entry) = self.disk_cache().load(&key) else {
                continue;
            };
            if entry.producer != PRODUCER {
                continue;
            }
            let p = &entry.parts;
            let id = (
                p.source.clone(),
                p.options.clone(),
                p.name_expressions.clone(),
                p.headers.clone(),
            );
            if seen.insert(id) {
                out.push(*entry);
            }
        }
        out
    }
}

/// Whether the module `recipe` holds can be built for `target`: anything but an arch-specific
/// entry (`sm_90a`) can; such an entry only for its own architecture.
fn recipe_builds_for(recipe: &Entry, target: Target) -> bool {
    match recipe.parts.target.parse::<Target>() {
        Ok(t) if t.kind == TargetKind::SassArchSpecific => t.arch == target.arch,
        Ok(_) => true,
        Err(_) => false,
    }
}

/// Runs `compile` over `work` on `jobs` threads, counting origins and collecting failures.
fn run<I: Sync>(
    work: &[I],
    jobs: usize,
    compile: impl Fn(&I) -> (String, Target, Result<Compiled>) + Sync,
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
    let worker = || loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        let Some(item) = work.get(i) else {
            break;
        };
        let (what, target, result) = compile(item);
        let origin = match result {
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
                    .push(format!("{what} on {target}: {e}"));
                None
            }
        };
        progress(&WarmProgress {
            what: &what,
            target,
            origin,
            done: done.fetch_add(1, Ordering::Relaxed) + 1,
            total: work.len(),
        });
    };
    std::thread::scope(|scope| {
        let mut threads = 0;
        for _ in 0..jobs.min(work.len()) {
            let spawned = std::thread::Builder::new()
                .name("kiln-warm".into())
                .stack_size(super::background::COMPILE_STACK)
                .spawn_scoped(scope, worker);
            match spawned {
                Ok(_) => threads += 1,
                Err(e) => {
                    tracing::warn!(error = %e, "could not start a warm thread");
                    break;
                }
            }
        }
        // No thread could start: warm on this one.
        if threads == 0 {
            worker();
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
