//! Communicators: one per rank, each bound to one GPU.
//!
//! Every communicator is created non-blocking, so that kiln can put a deadline on everything
//! that waits for peers: its set-up polls NCCL until the ranks have met, and a commit holding
//! a collective is waited for by polling (see `runtime::timeline::Watch`). When the deadline
//! (`KILN_NCCL_TIMEOUT`) passes or NCCL reports an error, the communicator is aborted
//! (`ncclCommAbort`, which also stops its kernels) and the wait returns an error.

use std::collections::HashMap;
use std::ffi::c_void;
use std::path::Path;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use cudarc::nccl::sys::{ncclComm_t, ncclConfig_t, ncclUniqueId};

use super::hash_words::HashWords;
use super::library::{Nccl, IN_PROGRESS, SUCCESS};
use crate::env::{Config, Launch, LaunchId};
use crate::error::{Error, Result};
use crate::runtime::{Array, Device, Watch};
use crate::DType;

/// What all ranks of one communicator share: NCCL's unique id, made by one rank and handed to
/// the others (in one process directly, across processes through a file or the environment).
#[derive(Clone, Copy)]
pub struct UniqueId(pub(crate) ncclUniqueId);

const ID_BYTES: usize = 128;

impl UniqueId {
    /// A fresh id (NCCL opens its bootstrap socket here).
    pub fn new() -> Result<UniqueId> {
        let nccl = nccl()?;
        let mut id = ncclUniqueId {
            internal: [0; ID_BYTES],
        };
        // SAFETY: writes the 128-byte id.
        nccl.check(
            "ncclGetUniqueId",
            unsafe { (nccl.get_unique_id)(&mut id) },
            None,
        )?;
        Ok(UniqueId(id))
    }

    /// The id as 256 lowercase hex digits, for an environment variable or a file.
    pub fn to_hex(&self) -> String {
        self.0
            .internal
            .iter()
            .map(|&b| format!("{:02x}", b as u8))
            .collect()
    }

    /// Parses the form [`UniqueId::to_hex`] writes (surrounding whitespace ignored). Anything
    /// but 256 hex digits is [`Error::InvalidArgument`].
    pub fn from_hex(hex: &str) -> Result<UniqueId> {
        let hex = hex.trim();
        let bad = |why: &str| Error::InvalidArgument {
            arg: "id",
            reason: format!("an NCCL unique id is {} hex digits: {why}", 2 * ID_BYTES),
        };
        if hex.len() != 2 * ID_BYTES || !hex.is_ascii() {
            return Err(bad(&format!("got {} characters", hex.len())));
        }
        // `from_str_radix` alone takes a sign too: "+f" would pass as 0f.
        if !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad("found a character that is not a hex digit"));
        }
        let mut id = ncclUniqueId {
            internal: [0; ID_BYTES],
        };
        for (i, b) in id.internal.iter_mut().enumerate() {
            let byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
                .map_err(|_| bad("found a character that is not a hex digit"))?;
            *b = byte as std::ffi::c_char;
        }
        Ok(UniqueId(id))
    }

    /// Writes the id to `path` atomically (a reader never sees half of it).
    pub fn write_to(&self, path: &Path) -> Result<()> {
        let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
        std::fs::write(&tmp, self.to_hex()).map_err(|e| Error::io("writing", &tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| Error::io("publishing", path, e))
    }

    /// Reads the id rank 0 writes to `path`, waiting up to `timeout` for the file to appear.
    pub fn read_from(path: &Path, timeout: Duration) -> Result<UniqueId> {
        let start = Instant::now();
        loop {
            match std::fs::read_to_string(path) {
                Ok(text) => return UniqueId::from_hex(&text),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    if start.elapsed() > timeout {
                        let why = format!(
                            "rank 0 did not write it within {} s (KILN_NCCL_TIMEOUT)",
                            timeout.as_secs_f64()
                        );
                        return Err(Error::io(
                            "waiting for the NCCL id file",
                            path,
                            std::io::Error::new(std::io::ErrorKind::TimedOut, why),
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(Error::io("reading the NCCL id", path, e)),
            }
        }
    }
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId({}...)", &self.to_hex()[..16])
    }
}

fn nccl() -> Result<&'static Nccl> {
    let config = Config::from_env()?;
    Nccl::get(config.nccl_lib.as_deref())
}

/// Where a communicator stands.
enum State {
    Live(ncclComm_t),
    /// Aborted or destroyed: the reason, for every later use.
    Failed(String),
}

/// Host memory the device writes when a collective check fails: [differing rank + 1, own hash],
/// and the address the device writes it at.
struct Status(*mut u64, sys::CUdeviceptr);

/// One rank's communicator, shared with the commits that hold its collectives (they watch it).
pub(crate) struct Shared {
    pub(crate) nccl: &'static Nccl,
    pub(crate) device: Arc<Device>,
    pub(crate) rank: usize,
    pub(crate) nranks: usize,
    pub(crate) timeout: Duration,
    state: Mutex<State>,
    /// Set by the check kernel (None when `KILN_NCCL_CHECK=0`).
    status: Option<Status>,
    /// Where this rank's hashes are sent from (None when `KILN_NCCL_CHECK=0`).
    hash_words: Option<Mutex<HashWords>>,
    mismatch_reported: AtomicBool,
    /// When, in the current wait, NCCL was last asked for its error state.
    last_asked_us: AtomicU64,
    /// What each checked collective's hash stands for, for the mismatch message.
    described: Mutex<HashMap<u32, String>>,
    /// Process-unique, to tell communicators apart in graph signatures.
    pub(crate) id: u64,
}

// SAFETY: the NCCL handle is only used under the state mutex; the status pointer is pinned host
// memory that lives as long as this value and is only read.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

/// A rank of an NCCL communicator on one GPU. Collectives on it are encoded on a
/// [`CommandEncoder`](crate::runtime::CommandEncoder) of the same GPU, ordered with the
/// encoder's other work. Use it from one thread at a time, with one encoder at a time; each
/// rank of a process driving several GPUs lives on its own thread.
pub struct Communicator {
    pub(crate) shared: Arc<Shared>,
    /// The same value as a watch, to hand to commits.
    pub(crate) watch: Arc<dyn Watch>,
    /// Device memory for the collective check: the hashes the ranks sent (words 4..4 +
    /// nranks). Every collective writes it, which orders them in graph mode (NCCL needs one
    /// communicator's collectives in the order they were issued).
    pub(crate) order: Array,
    /// The check kernel; None when `KILN_NCCL_CHECK=0`.
    pub(crate) check_kernel: Option<Arc<crate::jit::LoadedKernel>>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Communicator(rank {} of {} on GPU {})",
            self.shared.rank,
            self.shared.nranks,
            self.shared.device.ordinal()
        )
    }
}

impl Communicator {
    /// Rank `rank` of `nranks` on `device`, meeting the other ranks through `id`. Waits until
    /// all ranks have joined, at most `KILN_NCCL_TIMEOUT`.
    pub fn init_rank(
        device: &Arc<Device>,
        nranks: usize,
        rank: usize,
        id: &UniqueId,
    ) -> Result<Communicator> {
        if nranks == 0 || rank >= nranks {
            return Err(Error::InvalidArgument {
                arg: "rank",
                reason: format!("rank {rank} of {nranks}: expected a rank below nranks"),
            });
        }
        let config = Config::from_env()?;
        let nccl = Nccl::get(config.nccl_lib.as_deref())?;
        let comm = start_init(nccl, device, nranks, rank, id)?;
        let shared = Shared::new(nccl, device, rank, nranks, comm, &config)?;
        shared.wait_ready("communicator set-up")?;
        Communicator::finish(shared, config.nccl_check)
    }

    /// One communicator per device, all in this process (rank i on `devices[i]`). Hand each to
    /// its own thread, with its own encoder.
    pub fn init_all(devices: &[Arc<Device>]) -> Result<Vec<Communicator>> {
        if devices.is_empty() {
            return Err(Error::InvalidArgument {
                arg: "devices",
                reason: "no devices".into(),
            });
        }
        let config = Config::from_env()?;
        let nccl = Nccl::get(config.nccl_lib.as_deref())?;
        let id = UniqueId::new()?;
        let n = devices.len();
        // Inside a group, NCCL sets up all ranks together instead of waiting in the first.
        // SAFETY: group calls have no preconditions; every start is matched by the end below.
        nccl.check("ncclGroupStart", unsafe { (nccl.group_start)() }, None)?;
        let mut started = Vec::with_capacity(n);
        let mut failure = None;
        for (rank, device) in devices.iter().enumerate() {
            match start_init(nccl, device, n, rank, &id) {
                Ok(comm) => started.push(comm),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        // SAFETY: ends the group started above.
        let ended = nccl.check("ncclGroupEnd", unsafe { (nccl.group_end)() }, None);
        let mut shared = Vec::with_capacity(n);
        for (rank, comm) in started.into_iter().enumerate() {
            shared.push(Shared::new(nccl, &devices[rank], rank, n, comm, &config)?);
        }
        if let Some(e) = failure {
            return Err(e);
        }
        ended?;
        for s in &shared {
            s.wait_ready("communicator set-up")?;
        }
        shared
            .into_iter()
            .map(|s| Communicator::finish(s, config.nccl_check))
            .collect()
    }

    /// This process's rank of a job launched one process per GPU, as the environment describes
    /// it (`KILN_RANK`, `KILN_WORLD_SIZE`, and `KILN_NCCL_ID` or `KILN_NCCL_ID_FILE`). With a
    /// file, rank 0 makes the id and writes it there; give each run a fresh path, since a stale
    /// file would send the other ranks to a meeting nobody attends (they time out).
    pub fn from_env(device: &Arc<Device>) -> Result<Communicator> {
        let launch = Launch::from_env()?;
        let config = Config::from_env()?;
        let id = match &launch.id {
            LaunchId::Hex(hex) => UniqueId::from_hex(hex)?,
            LaunchId::File(path) if launch.rank == 0 => {
                let id = UniqueId::new()?;
                id.write_to(path)?;
                id
            }
            LaunchId::File(path) => {
                UniqueId::read_from(path, Duration::from_secs_f64(config.nccl_timeout_s))?
            }
        };
        Communicator::init_rank(device, launch.world_size, launch.rank, &id)
    }

    fn finish(shared: Shared, check: bool) -> Result<Communicator> {
        let device = &shared.device;
        // Allocated with the check off too: graph mode orders a communicator's collectives by
        // the writes they all make to this array.
        let words = Array::empty(device, DType::F32, &[4 + shared.nranks])?;
        device.bind()?;
        // SAFETY: the range is the array's own; zero means "no hash received".
        check_driver(unsafe { sys::cuMemsetD32_v2(words.device_ptr(), 0, 4 + shared.nranks) })?;
        let check_kernel = if check {
            Some(device.kernel(&super::collective::check_spec())?)
        } else {
            None
        };
        let shared = Arc::new(shared);
        Ok(Communicator {
            watch: shared.clone(),
            shared,
            order: words,
            check_kernel,
        })
    }

    /// This communicator's rank, below [`nranks`](Communicator::nranks).
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// The number of ranks in the communicator.
    pub fn nranks(&self) -> usize {
        self.shared.nranks
    }

    /// The GPU this rank runs on; its collectives are encoded on an encoder of this device.
    pub fn device(&self) -> &Arc<Device> {
        &self.shared.device
    }

    /// Aborts the communicator now: its pending collectives stop, and every later use is an
    /// error. The other ranks' collectives then time out (or fail, where NCCL notices).
    pub fn abort(&self) {
        self.shared.abort("aborted by the program".into());
    }
}

/// Starts a non-blocking `ncclCommInitRankConfig` on `device`.
fn start_init(
    nccl: &'static Nccl,
    device: &Arc<Device>,
    nranks: usize,
    rank: usize,
    id: &UniqueId,
) -> Result<ncclComm_t> {
    device.bind()?;
    let mut config = non_blocking_config();
    let mut comm: ncclComm_t = ptr::null_mut();
    // SAFETY: the config is initialised as NCCL_CONFIG_INITIALIZER does; NCCL keeps no pointer
    // to it; the communicator handle is written before the call returns.
    let status = unsafe {
        (nccl.comm_init_rank_config)(&mut comm, nranks as i32, id.0, rank as i32, &mut config)
    };
    if status != SUCCESS && status != IN_PROGRESS {
        return Err(nccl.error("ncclCommInitRankConfig", status, None));
    }
    Ok(comm)
}

/// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`: every field NCCL_CONFIG_UNDEF_* (NCCL's
/// default) except the header, which tells NCCL which fields this struct has.
fn non_blocking_config() -> ncclConfig_t {
    const UNDEF: i32 = i32::MIN;
    ncclConfig_t {
        size: std::mem::size_of::<ncclConfig_t>(),
        magic: 0xcafe_beef,
        // The struct's own version (cudarc's binding is NCCL 2.30's header).
        version: 23000,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

pub(crate) fn check_driver(status: sys::CUresult) -> Result<()> {
    if status == sys::cudaError_enum::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Driver(cudarc::driver::DriverError(status)))
    }
}

impl Shared {
    fn new(
        nccl: &'static Nccl,
        device: &Arc<Device>,
        rank: usize,
        nranks: usize,
        comm: ncclComm_t,
        config: &Config,
    ) -> Result<Shared> {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let mut shared = Shared {
            nccl,
            device: device.clone(),
            rank,
            nranks,
            timeout: Duration::from_secs_f64(config.nccl_timeout_s),
            state: Mutex::new(State::Live(comm)),
            status: None,
            hash_words: None,
            mismatch_reported: AtomicBool::new(false),
            last_asked_us: AtomicU64::new(0),
            described: Mutex::new(HashMap::new()),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        };
        if config.nccl_check {
            device.bind()?;
            let mut host: *mut c_void = ptr::null_mut();
            // SAFETY: allocates 16 bytes of pinned host memory the device can write.
            check_driver(unsafe {
                sys::cuMemHostAlloc(
                    &mut host,
                    16,
                    sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
                )
            })?;
            // SAFETY: the allocation is 16 bytes.
            unsafe { ptr::write_bytes(host as *mut u8, 0, 16) };
            let mut device_address: sys::CUdeviceptr = 0;
            // SAFETY: `host` was allocated with CU_MEMHOSTALLOC_DEVICEMAP.
            check_driver(unsafe {
                sys::cuMemHostGetDevicePointer_v2(&mut device_address, host, 0)
            })?;
            shared.status = Some(Status(host as *mut u64, device_address));
            shared.hash_words = Some(Mutex::new(HashWords::new(device)?));
        }
        Ok(shared)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn failed(&self, reason: &str) -> Error {
        Error::CommunicatorFailed {
            rank: self.rank,
            nranks: self.nranks,
            reason: reason.to_string(),
        }
    }

    /// Runs `call` with the live handle, or fails if the communicator is not live.
    pub(crate) fn with_comm<T>(&self, call: impl FnOnce(ncclComm_t) -> Result<T>) -> Result<T> {
        let state = self.lock();
        match &*state {
            State::Live(comm) => call(*comm),
            State::Failed(reason) => Err(self.failed(reason)),
        }
    }

    /// Waits until NCCL has finished the calls made so far (a non-blocking communicator may
    /// return before it has: set-up, connecting to peers on a first collective), at most the
    /// timeout; aborts the communicator on an error or at the deadline.
    pub(crate) fn wait_ready(&self, what: &str) -> Result<()> {
        let start = Instant::now();
        loop {
            let status = self.async_state();
            match status {
                Ok(SUCCESS) => return Ok(()),
                Ok(_) => {}
                Err(e) => {
                    self.abort(e.to_string());
                    return Err(e);
                }
            }
            let waited = start.elapsed();
            if waited > self.timeout {
                self.abort(format!("{what} timed out"));
                return Err(self.timed_out(what));
            }
            if waited > Duration::from_micros(100) {
                std::thread::sleep(Duration::from_micros(50));
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// NCCL's state of the communicator: `SUCCESS`, `IN_PROGRESS`, or the error it reports
    /// (the caller aborts).
    fn async_state(&self) -> Result<i32> {
        self.with_comm(|comm| {
            let mut status = SUCCESS;
            // SAFETY: the handle is live (checked under the lock).
            let call = unsafe { (self.nccl.comm_get_async_error)(comm, &mut status) };
            self.nccl.check("ncclCommGetAsyncError", call, Some(comm))?;
            if status != SUCCESS && status != IN_PROGRESS {
                return Err(self.nccl.error("ncclCommGetAsyncError", status, Some(comm)));
            }
            Ok(status)
        })
    }

    fn timed_out(&self, what: &str) -> Error {
        Error::CollectiveTimeout {
            what: what.to_string(),
            rank: self.rank,
            nranks: self.nranks,
            seconds: self.timeout.as_secs_f64(),
        }
    }

    /// Aborts the communicator (once), stopping its kernels; later uses fail with `reason`.
    ///
    /// `ncclCommAbort` runs on a thread of its own that nobody waits for: it was seen to block
    /// when the ranks of a healthy communicator abort together (after a detected mismatch), and
    /// an error must never turn into a hang. Its kernels stop when it sets NCCL's abort flag,
    /// which it does before anything that can block.
    pub(crate) fn abort(&self, reason: String) {
        let mut state = self.lock();
        if let State::Live(comm) = &*state {
            struct Handle(ncclComm_t);
            // SAFETY: the handle moves to the aborting thread and is never used here again.
            unsafe impl Send for Handle {}
            let handle = Handle(*comm);
            let (nccl, device, rank) = (self.nccl, self.device.clone(), self.rank);
            tracing::debug!("rank {rank}: aborting the communicator: {reason}");
            let spawned = std::thread::Builder::new()
                .name(format!("kiln-nccl-abort-{rank}"))
                .spawn(move || {
                    let handle = handle;
                    let _ = device.bind();
                    // SAFETY: the handle is live and only this thread uses it from now on.
                    let status = unsafe { (nccl.comm_abort)(handle.0) };
                    tracing::debug!("rank {rank}: aborted ({status})");
                });
            if let Err(e) = spawned {
                tracing::warn!("rank {rank}: could not start the abort: {e}");
            }
            *state = State::Failed(reason);
        }
    }

    /// Remembers what a checked collective's hash stands for.
    pub(crate) fn describe(&self, hash: u32, what: impl FnOnce() -> String) {
        let mut described = self.described.lock().unwrap_or_else(|e| e.into_inner());
        if described.len() > 4096 {
            described.clear();
        }
        described.entry(hash).or_insert_with(what);
    }

    /// The device address of a word holding `hash`, for the hash exchange (None with the
    /// check off). Call it outside stream capture.
    pub(crate) fn hash_word(&self, hash: u32) -> Result<Option<sys::CUdeviceptr>> {
        self.hash_words
            .as_ref()
            .map(|w| w.lock().unwrap_or_else(|e| e.into_inner()).word(hash))
            .transpose()
    }

    /// Where the check kernel writes its finding (None with the check off).
    pub(crate) fn status_device_ptr(&self) -> Option<sys::CUdeviceptr> {
        self.status.as_ref().map(|s| s.1)
    }
}

impl Watch for Shared {
    fn usable(&self) -> Result<()> {
        self.with_comm(|_| Ok(()))
    }

    fn waiting(&self, waited: Duration) -> Result<()> {
        // NCCL's error state changes rarely: ask it every few milliseconds, not at every poll.
        let now = waited.as_micros() as u64;
        let last = self.last_asked_us.load(Ordering::Relaxed);
        if now >= last && now - last < 5_000 && waited <= self.timeout {
            return Ok(());
        }
        self.last_asked_us.store(now, Ordering::Relaxed);
        let async_error = self.async_state();
        if let Err(e) = async_error {
            self.abort(e.to_string());
            return Err(e);
        }
        if waited > self.timeout {
            self.abort("a collective timed out".into());
            return Err(self.timed_out("a collective"));
        }
        Ok(())
    }

    fn finished(&self) -> Result<()> {
        let Some(Status(host, _)) = &self.status else {
            return Ok(());
        };
        // SAFETY: pinned host memory of two words, written by the device before the commit's
        // event completed (the kernel fences its writes to the system).
        let (flag, own) = unsafe { (ptr::read_volatile(*host), ptr::read_volatile(host.add(1))) };
        if flag == 0 || self.mismatch_reported.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let ours = self
            .described
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(own as u32))
            .cloned()
            .unwrap_or_else(|| "a collective".into());
        self.abort(format!("collective mismatch: this rank called {ours}"));
        Err(Error::CollectiveMismatch {
            rank: self.rank,
            nranks: self.nranks,
            peer: (flag - 1) as usize,
            ours,
        })
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let live = match &*self.lock() {
            State::Live(comm) => Some(*comm),
            State::Failed(_) => None,
        };
        if let Some(comm) = live {
            let _ = self.device.bind();
            // Flush the communicator's work; a peer that never completes it ends in an abort.
            // SAFETY: the handle is live; nothing else uses it any more (this is the last
            // reference).
            let status = unsafe { (self.nccl.comm_finalize)(comm) };
            let flushed = (status == SUCCESS || status == IN_PROGRESS)
                && self.wait_ready("communicator finalisation").is_ok();
            if flushed {
                // SAFETY: finalised; destroyed once.
                unsafe { (self.nccl.comm_destroy)(comm) };
                *self.lock() = State::Failed("destroyed".into());
            } else {
                self.abort("finalisation failed".into());
            }
        }
        // After an abort a check kernel may still be queued behind the stopped collective:
        // its host memory is then left allocated rather than freed under it.
        let aborted = matches!(&*self.lock(), State::Failed(r) if r != "destroyed");
        if let (true, Some(words)) = (aborted, &self.hash_words) {
            words.lock().unwrap_or_else(|e| e.into_inner()).leak();
        }
        if let Some(Status(host, _)) = self.status.take().filter(|_| !aborted) {
            // SAFETY: allocated by cuMemHostAlloc; the device no longer writes it (every commit
            // watching this communicator has finished, or it would hold a reference).
            unsafe { sys::cuMemFreeHost(host as *mut c_void) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_ids_round_trip_through_hex_and_files() {
        let mut raw = ncclUniqueId {
            internal: [0; ID_BYTES],
        };
        for (i, b) in raw.internal.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(37) as std::ffi::c_char;
        }
        let id = UniqueId(raw);
        let hex = id.to_hex();
        assert_eq!(hex.len(), 256);
        assert_eq!(UniqueId::from_hex(&hex).unwrap().0, raw);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("id");
        id.write_to(&path).unwrap();
        assert_eq!(
            UniqueId::read_from(&path, Duration::from_secs(1))
                .unwrap()
                .0,
            raw
        );
        for bad in ["", "00", &hex[..254], &format!("{}zz", &hex[..254])] {
            assert!(UniqueId::from_hex(bad).is_err(), "{bad:?}");
        }
        let missing = UniqueId::read_from(&dir.path().join("none"), Duration::from_millis(30));
        assert!(matches!(missing, Err(Error::Io { .. })));
    }

    #[test]
    fn a_signed_hex_id_is_refused() {
        // 128 pairs "+f": each parsed as 0x0f, a different id than any rank wrote.
        let signed = "+f".repeat(ID_BYTES);
        let err = UniqueId::from_hex(&signed).unwrap_err();
        assert_eq!(err.argument(), Some("id"), "{err}");
    }
}
