//! A stream's timeline: the commits an encoder has launched and not yet seen finish, each with
//! an event recorded after it. The encoder and the allocator share it: the encoder to bound the
//! work it keeps in flight, the allocator to know when memory that work used may be handed to
//! another stream or returned to the driver.
//!
//! Commits are numbered from 1 in launch order. A [`Fence`] names one commit of one timeline;
//! memory fenced by it is safe for anyone once the stream has run past that commit, and at once
//! for later work on the same stream, which runs after it in stream order.

use std::collections::VecDeque;
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::{sys, DriverError};

use crate::error::{Error, Result};
use crate::jit::LoadedKernel;

/// A commit the GPU may still be running.
struct Pending {
    seq: u64,
    event: sys::CUevent,
    /// Bytes the commit touched (inputs plus outputs, as the per-commit limit counts them).
    bytes: usize,
    /// Modules stay loaded until the work that runs their kernels is done.
    _kernels: Vec<Arc<LoadedKernel>>,
    /// Work in the commit that may never finish by itself (a collective waiting for a peer).
    watches: Vec<Arc<dyn Watch>>,
}

/// Work that may wait on something outside this process's control (a collective waits for its
/// peers): a wait for a commit holding such work polls instead of blocking, so that a peer that
/// died becomes an error instead of a hang.
pub(crate) trait Watch: Send + Sync {
    /// Called while a wait for the commit has lasted `waited`. An error ends the wait; before
    /// returning it, the watch must make its work finish (a communicator is aborted).
    fn waiting(&self, waited: Duration) -> Result<()>;
    /// Called once the commit has finished: an error reports what the work found wrong.
    fn finished(&self) -> Result<()>;
    /// Called before kept work is launched again without being issued anew: an error (the
    /// communicator has failed) stops it.
    fn usable(&self) -> Result<()>;
}

/// How long a wait that was ended by an error keeps waiting for the aborted work to drain.
const DRAIN: Duration = Duration::from_secs(10);

#[derive(Default)]
struct State {
    pending: VecDeque<Pending>,
    spare_events: Vec<sys::CUevent>,
    bytes_in_flight: usize,
}

pub(crate) struct Timeline {
    id: u64,
    /// The newest commit known to have finished; `u64::MAX` once the timeline is closed.
    completed: AtomicU64,
    /// The newest commit launched.
    committed: AtomicU64,
    state: Mutex<State>,
}

// SAFETY: the raw events are only used under the state mutex, and CUDA events may be queried,
// recorded and destroyed from any thread.
unsafe impl Send for Timeline {}
unsafe impl Sync for Timeline {}

fn check(status: sys::CUresult) -> Result<()> {
    if status == sys::cudaError_enum::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Driver(DriverError(status)))
    }
}

impl Timeline {
    pub(crate) fn new() -> Arc<Timeline> {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        Arc::new(Timeline {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            completed: AtomicU64::new(0),
            committed: AtomicU64::new(0),
            state: Mutex::new(State::default()),
        })
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The number the next commit will get: work encoded now belongs to it.
    pub(crate) fn next_seq(&self) -> u64 {
        self.committed.load(Ordering::Acquire) + 1
    }

    /// Whether commit `seq` is known to have finished (no driver call; see [`Timeline::poll`]).
    pub(crate) fn is_done(&self, seq: u64) -> bool {
        seq <= self.completed.load(Ordering::Acquire)
    }

    /// Records the end of commit `next_seq()` on `stream` (the context must be current).
    pub(crate) fn record(
        &self,
        stream: sys::CUstream,
        bytes: usize,
        kernels: Vec<Arc<LoadedKernel>>,
        watches: Vec<Arc<dyn Watch>>,
    ) -> Result<()> {
        let mut state = self.lock();
        let event = match state.spare_events.pop() {
            Some(e) => e,
            None => {
                let mut e = ptr::null_mut();
                // SAFETY: the caller made the stream's context current.
                check(unsafe {
                    sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
                })?;
                e
            }
        };
        // SAFETY: event and stream are live.
        if let Err(e) = check(unsafe { sys::cuEventRecord(event, stream) }) {
            state.spare_events.push(event);
            return Err(e);
        }
        let seq = self.next_seq();
        state.pending.push_back(Pending {
            seq,
            event,
            bytes,
            _kernels: kernels,
            watches,
        });
        state.bytes_in_flight += bytes;
        self.committed.store(seq, Ordering::Release);
        Ok(())
    }

    /// Commits launched and not yet seen finished, and the bytes they touched.
    pub(crate) fn in_flight(&self) -> (usize, usize) {
        let state = self.lock();
        (state.pending.len(), state.bytes_in_flight)
    }

    /// Whether a commit in flight holds watched work (a collective).
    pub(crate) fn watched_in_flight(&self) -> bool {
        self.lock().pending.iter().any(|p| !p.watches.is_empty())
    }

    /// Retires every commit that has finished, oldest first.
    pub(crate) fn poll(&self) -> Result<()> {
        let mut state = self.lock();
        while let Some(front) = state.pending.front() {
            // SAFETY: the event is live.
            let status = unsafe { sys::cuEventQuery(front.event) };
            if status == sys::cudaError_enum::CUDA_ERROR_NOT_READY {
                break;
            }
            check(status)?;
            self.retire_front(&mut state)?;
        }
        Ok(())
    }

    /// Retires the oldest commit, which has finished; its watches then report what they found.
    fn retire_front(&self, state: &mut State) -> Result<()> {
        let Some(done) = state.pending.pop_front() else {
            return Ok(());
        };
        state.bytes_in_flight -= done.bytes;
        state.spare_events.push(done.event);
        self.completed.fetch_max(done.seq, Ordering::AcqRel);
        done.watches.iter().try_for_each(|w| w.finished())
    }

    /// Waits for the oldest commit in flight; false if there was none.
    pub(crate) fn wait_oldest(&self) -> Result<bool> {
        let mut state = self.lock();
        let Some(front) = state.pending.front() else {
            return Ok(false);
        };
        if front.watches.is_empty() {
            // SAFETY: the event is live; holding the lock keeps it from being recycled meanwhile.
            check(unsafe { sys::cuEventSynchronize(front.event) })?;
        } else if let Err(e) = wait_watched(front.event, &front.watches) {
            tracing::debug!("watched wait ended: {e}");
            // The watch made its work finish (or tried to): retire the commit if it drained,
            // and report the finished work's own finding first (it names the cause).
            if wait_polling(front.event, DRAIN).unwrap_or(false) {
                self.retire_front(&mut state)?;
            }
            return Err(e);
        }
        self.retire_front(&mut state)?;
        Ok(true)
    }

    /// Waits until commit `seq` has finished; returns at once if it has not been launched yet
    /// (its work is still being encoded, so nothing can wait for it).
    pub(crate) fn wait_for(&self, seq: u64) -> Result<()> {
        if seq > self.committed.load(Ordering::Acquire) {
            return Ok(());
        }
        while !self.is_done(seq) && self.wait_oldest()? {}
        Ok(())
    }

    /// Marks every commit finished and frees the events: the owner has synchronised its stream
    /// and launches nothing more.
    pub(crate) fn close(&self) {
        let mut state = self.lock();
        let state = &mut *state;
        let pending = state.pending.drain(..).map(|p| p.event);
        for e in pending.chain(state.spare_events.drain(..)) {
            // SAFETY: the stream was synchronised, so no event is pending.
            unsafe { sys::cuEventDestroy_v2(e) };
        }
        state.bytes_in_flight = 0;
        self.completed.store(u64::MAX, Ordering::Release);
    }
}

impl Drop for Timeline {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for e in state
            .spare_events
            .drain(..)
            .chain(state.pending.drain(..).map(|p| p.event))
        {
            // SAFETY: nothing else refers to the timeline's events any more.
            unsafe { sys::cuEventDestroy_v2(e) };
        }
    }
}

/// Polls `event` until it completes, asking the watches at each poll whether to go on waiting.
fn wait_watched(event: sys::CUevent, watches: &[Arc<dyn Watch>]) -> Result<()> {
    let start = Instant::now();
    loop {
        if query(event)? {
            return Ok(());
        }
        let waited = start.elapsed();
        for w in watches {
            w.waiting(waited)?;
        }
        pause(waited);
    }
}

/// Polls `event` for up to `limit`; whether it completed.
fn wait_polling(event: sys::CUevent, limit: Duration) -> Result<bool> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if query(event)? {
            return Ok(true);
        }
        pause(start.elapsed());
    }
    Ok(false)
}

fn query(event: sys::CUevent) -> Result<bool> {
    // SAFETY: the caller holds the timeline's lock, so the event is live.
    let status = unsafe { sys::cuEventQuery(event) };
    if status == sys::cudaError_enum::CUDA_ERROR_NOT_READY {
        return Ok(false);
    }
    check(status).map(|()| true)
}

/// Spins briefly (a collective usually finishes within microseconds of the wait starting), then
/// sleeps in short steps.
fn pause(waited: Duration) {
    if waited < Duration::from_micros(200) {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// Work on one stream asking for memory: it may reuse memory whose uses on that stream end at
/// commit `through` or earlier, since stream order runs it after them.
#[derive(Clone, Copy)]
pub(crate) struct Reuser<'a> {
    pub timeline: &'a Timeline,
    pub through: u64,
}

/// One commit of one timeline: the last work of that stream that may touch some memory.
#[derive(Clone)]
pub(crate) struct Fence {
    timeline: Arc<Timeline>,
    seq: u64,
}

impl Fence {
    pub(crate) fn new(timeline: &Arc<Timeline>, seq: u64) -> Fence {
        Fence {
            timeline: timeline.clone(),
            seq,
        }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.timeline.is_done(self.seq)
    }

    pub(crate) fn timeline(&self) -> &Arc<Timeline> {
        &self.timeline
    }

    /// Whether memory under this fence may be used by `reuser` (`None`: by anyone, including
    /// the host and the driver): once the fenced work is done, or at once by later work on the
    /// same stream.
    pub(crate) fn allows(&self, reuser: Option<Reuser>) -> bool {
        self.is_done()
            || reuser.is_some_and(|r| r.timeline.id == self.timeline.id && self.seq <= r.through)
    }

    /// Records a later use on the same timeline, or returns false for another timeline.
    pub(crate) fn advance(&mut self, timeline: &Arc<Timeline>, seq: u64) -> bool {
        if self.timeline.id != timeline.id {
            return false;
        }
        self.seq = self.seq.max(seq);
        true
    }
}

#[cfg(test)]
impl Timeline {
    /// Test support: pretend commits up to `seq` were launched and `done` of them finished.
    pub(crate) fn fake_progress(&self, committed: u64, done: u64) {
        self.committed.store(committed, Ordering::Release);
        self.completed.store(done, Ordering::Release);
    }
}
