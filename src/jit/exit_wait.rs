//! Process exit waits for the compiles in flight.
//!
//! `exit` runs the destructors of the libraries a process loaded, NVRTC's among them, while
//! other threads keep running. A compile still running on a background thread then works in a
//! library being torn down: a segfault, a heap-corruption abort, a hang or an "out of memory"
//! from NVRTC's compiler, after the program's own work succeeded. So every compile holds a
//! [`Call`] while it runs and while its cache entry is written, and a handler registered with
//! `atexit` refuses new calls and waits for those in flight. Handlers run in the reverse order
//! of registration, and NVRTC registers destructors when it is loaded and on first use; so the
//! handler is registered after loading and again after a first, trivial compile, which then
//! runs before every one of them.

use std::sync::{Condvar, Mutex};

use crate::error::{Error, Result};

struct InFlight {
    calls: usize,
    exiting: bool,
}

static IN_FLIGHT: Mutex<InFlight> = Mutex::new(InFlight {
    calls: 0,
    exiting: false,
});
static FINISHED: Condvar = Condvar::new();

/// One compile in flight; dropping it lets a waiting exit go on.
pub(crate) struct Call(());

impl Call {
    /// Counts a compile in flight, or refuses it once the process is exiting.
    pub(crate) fn start(call: &'static str) -> Result<Call> {
        let mut state = IN_FLIGHT.lock().unwrap_or_else(|e| e.into_inner());
        if state.exiting {
            return Err(Error::Nvrtc {
                call,
                message: "the process is exiting; no new compile starts".into(),
            });
        }
        state.calls += 1;
        Ok(Call(()))
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        let mut state = IN_FLIGHT.lock().unwrap_or_else(|e| e.into_inner());
        state.calls -= 1;
        if state.calls == 0 {
            FINISHED.notify_all();
        }
    }
}

/// Whether the process has begun to exit (background workers stop taking work).
pub(crate) fn exiting() -> bool {
    IN_FLIGHT.lock().unwrap_or_else(|e| e.into_inner()).exiting
}

/// Registers [`wait_for_calls`] with `atexit`: when NVRTC is loaded, and again after its first
/// compile. The later registration runs first; the second wait finds nothing in flight.
pub(crate) fn register_at_exit() {
    // SAFETY: `wait_for_calls` is an `extern "C" fn()` that never unwinds (it only locks
    // and waits). A failed registration (out of memory) leaves exit as it was before.
    let status = unsafe { libc::atexit(wait_for_calls) };
    if status != 0 {
        tracing::warn!("could not register the exit handler that waits for NVRTC compiles");
    }
}

extern "C" fn wait_for_calls() {
    let mut state = IN_FLIGHT.lock().unwrap_or_else(|e| e.into_inner());
    state.exiting = true;
    while state.calls > 0 {
        state = FINISHED.wait(state).unwrap_or_else(|e| e.into_inner());
    }
}
