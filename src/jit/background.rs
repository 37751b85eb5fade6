//! Background compiles. A miss compiles what the call needs on the caller's thread; what the
//! next calls will likely need (the other passes of a convolution, a norm's VJP) is queued here
//! first, so that its NVRTC time overlaps the caller's compile and work instead of following it.
//!
//! Workers start on the first queued spec, `KILN_COMPILE_THREADS` of them (default: one per
//! CPU; 0 turns queueing off). They compile through [`Jit::compile`], whose single flight makes
//! a caller that asks for a spec a worker is compiling wait for that compile rather than start
//! another; a spec nobody has started yet is simply compiled by whoever gets to it first.
//! Failures are logged and dropped: the call that needs the spec compiles it again and gets the
//! error itself.
//!
//! Urgent specs (the stand-ins the next calls of a cold start run, see `KILN_STAND_INS`) skip
//! the queue: each gets a thread of its own at once. On Linux the queue's workers run at a lower
//! scheduling priority (nice +10), so that while they fill every core, the calling thread's and
//! the urgent compiles still get theirs.

use std::collections::{HashSet, VecDeque};
use std::sync::{Condvar, Mutex, OnceLock};

use super::compiler::Jit;
use super::spec::KernelSpec;
use super::target::Target;

/// Stack of a thread that runs NVRTC. NVRTC compiles on the calling thread, and a thread's
/// default 2 MiB was not always enough: a background compile thread overflowed it under
/// compute-sanitizer (H100, f32 3x3 backward-data); the main thread has 8 MiB. Only the pages
/// a compile touches are committed.
pub(crate) const COMPILE_STACK: usize = 16 << 20;

/// The queue of one JIT's background compiles.
#[derive(Default)]
pub(crate) struct Background {
    state: Mutex<State>,
    wake: Condvar,
    started: OnceLock<()>,
}

#[derive(Default)]
struct State {
    queue: VecDeque<(KernelSpec, Target)>,
    /// Everything ever queued: a spec is compiled in the background at most once.
    seen: HashSet<(KernelSpec, Target)>,
    /// Queued or being compiled, for [`Jit::background_idle`].
    pending: usize,
}

impl Jit {
    /// Queues `specs` for compiling on `target` in the background (see the module's notes).
    /// Specs queued before are skipped; with `KILN_COMPILE_THREADS=0` nothing is queued.
    pub fn prefetch(&'static self, specs: impl IntoIterator<Item = KernelSpec>, target: Target) {
        let threads = self.config().compile_threads;
        if threads == 0 {
            return;
        }
        let bg = self.background();
        let mut added = false;
        {
            let mut state = bg.state.lock().unwrap_or_else(|e| e.into_inner());
            for spec in specs {
                if state.seen.insert((spec, target)) {
                    state.queue.push_back((spec, target));
                    state.pending += 1;
                    added = true;
                }
            }
        }
        if !added {
            return;
        }
        bg.started.get_or_init(|| {
            for i in 0..threads {
                let spawned = std::thread::Builder::new()
                    .name(format!("kiln-compile-{i}"))
                    .stack_size(COMPILE_STACK)
                    .spawn(move || self.background_worker());
                if let Err(e) = spawned {
                    tracing::warn!(error = %e, "could not start a background compile thread");
                }
            }
        });
        bg.wake.notify_all();
    }

    /// Compiles `specs` on `target` in the background now, each on a thread of its own rather
    /// than behind the queue: for what the very next calls need. A spec still waiting in the
    /// queue is taken out of it; one already started or done is left alone. With
    /// `KILN_COMPILE_THREADS=0` nothing is compiled in the background.
    pub fn prefetch_urgent(
        &'static self,
        specs: impl IntoIterator<Item = KernelSpec>,
        target: Target,
    ) {
        if self.config().compile_threads == 0 {
            return;
        }
        let bg = self.background();
        let mut urgent = Vec::new();
        {
            let mut state = bg.state.lock().unwrap_or_else(|e| e.into_inner());
            for spec in specs {
                let item = (spec, target);
                if state.seen.insert(item) {
                    state.pending += 1;
                    urgent.push(item);
                } else if let Some(i) = state.queue.iter().position(|q| *q == item) {
                    state.queue.remove(i);
                    urgent.push(item);
                }
            }
        }
        for (spec, target) in urgent {
            let spawned = std::thread::Builder::new()
                .name("kiln-compile-urgent".into())
                .stack_size(COMPILE_STACK)
                .spawn(move || self.compile_one(spec, target));
            if let Err(e) = spawned {
                // The call that needs the spec compiles it itself.
                tracing::warn!(error = %e, "could not start an urgent compile thread");
                bg.state.lock().unwrap_or_else(|e| e.into_inner()).pending -= 1;
            }
        }
    }

    /// Whether every queued background compile has finished (for tests and benchmarks).
    pub fn background_idle(&self) -> bool {
        self.background()
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pending
            == 0
    }

    fn background_worker(&'static self) {
        lower_priority();
        let bg = self.background();
        loop {
            let (spec, target) = {
                let mut state = bg.state.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if let Some(item) = state.queue.pop_front() {
                        break item;
                    }
                    state = bg.wake.wait(state).unwrap_or_else(|e| e.into_inner());
                }
            };
            if super::exit_wait::exiting() {
                // The process is exiting: no new compile may start (see `exit_wait`).
                return;
            }
            self.compile_one(spec, target);
        }
    }

    /// Compiles one background spec and counts it done.
    fn compile_one(&self, spec: KernelSpec, target: Target) {
        if let Err(e) = self.compile(&spec, target) {
            tracing::warn!(%spec, %target, error = %e, "background compile failed");
        }
        self.background()
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pending -= 1;
    }
}

/// Lowers the calling thread's scheduling priority to nice +10 (Linux, where a thread has a
/// nice value of its own; elsewhere nothing).
fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: setpriority reads and writes no memory of ours; on Linux, PRIO_PROCESS with
        // who = 0 names the calling thread. A failure leaves the priority as it was.
        let _ = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 10) };
    }
}

impl Background {
    pub(crate) fn new() -> Background {
        Background::default()
    }
}
