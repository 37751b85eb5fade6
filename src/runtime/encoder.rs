//! The command encoder: one per stream. Direct mode calls `cuLaunchKernel` at once; graph mode
//! (the default) records kernel nodes with their dependencies and, at commit, launches a CUDA
//! graph executable cached by the graph's topology key.
//!
//! At commit the encoder looks the key up in an LRU of executables. On a hit whose kernel
//! parameters are all identical it launches the executable as is; where only some nodes'
//! parameters changed it patches those nodes (`cuGraphExecKernelNodeSetParams`); otherwise it
//! builds the graph and calls `cuGraphExecUpdate`, re-instantiating if the update is refused. A
//! CUgraph is only built when an executable must be created or updated wholesale.
//!
//! Memory: every array an encoded op touches is marked as used by the encoder's current commit
//! (see `timeline`). Memory the program releases goes back to the allocator at once: later work
//! on this encoder may reuse it straight away (stream order, and in graph mode dependencies by
//! address, run that work after the old), so a repeated program settles on the same addresses
//! and its cached executable is launched as is; other streams, the host and the driver get it
//! only once the commits that used it have finished. Bounds on the commits and bytes in flight
//! make the host wait for the oldest commit when it runs too far ahead of the GPU.

use std::cell::OnceCell;
use std::ffi::c_void;
use std::num::NonZeroUsize;
use std::ptr;
use std::rc::Rc;
use std::sync::Arc;

use cudarc::driver::{sys, DriverError};
use lru::LruCache;

use super::allocator::Buffer;
use super::args::KernelArgs;
use super::array::Array;
use super::deps::{BufferId, DependencyTracker, NodeKind};
use super::device::Device;
use super::timeline::{Reuser, Timeline, Watch};
use crate::env::Config;
use crate::error::{Error, Result};
use crate::jit::LoadedKernel;

/// Counters since the encoder was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct EncoderStats {
    /// Kernels encoded (launched directly or added as graph nodes).
    pub launches: u64,
    /// Graphs launched.
    pub graph_commits: u64,
    /// Commits whose topology was in the executable cache.
    pub exec_cache_hits: u64,
    /// Hits launched without any update (identical parameters).
    pub exec_reuses: u64,
    /// Hits patched (node parameters set, or cuGraphExecUpdate).
    pub updates: u64,
    /// Executables instantiated, on a miss or after a refused update.
    pub instantiations: u64,
    /// Instantiations caused by a refused update.
    pub reinstantiations: u64,
    /// Executables evicted from the cache (and destroyed).
    pub evictions: u64,
    /// Commits that waited for the oldest commit in flight (the in-flight bounds).
    pub throttled_commits: u64,
    /// Node patches the driver refused although kiln judged them legal (then the whole graph
    /// was updated instead); 0 unless kiln's judgement is wrong.
    pub refused_patches: u64,
}

/// Which slot of the claim counters' ring (`CommandEncoder::claim_counter`) comes next, and how
/// many the commit being encoded has taken: no two launches of one commit share a slot.
#[derive(Debug, Default)]
struct ClaimSlots {
    next: usize,
    in_commit: usize,
}

impl ClaimSlots {
    /// The next slot of a ring of `slots`, or `None` once this commit has taken them all.
    fn take(&mut self, slots: usize) -> Option<usize> {
        if self.in_commit >= slots {
            return None;
        }
        let slot = self.next % slots;
        self.next = (slot + 1) % slots;
        self.in_commit += 1;
        Some(slot)
    }

    fn new_commit(&mut self) {
        self.in_commit = 0;
    }
}

/// Grid and block dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dim3(pub u32, pub u32, pub u32);

impl From<u32> for Dim3 {
    fn from(x: u32) -> Dim3 {
        Dim3(x, 1, 1)
    }
}
impl From<(u32, u32, u32)> for Dim3 {
    fn from((x, y, z): (u32, u32, u32)) -> Dim3 {
        Dim3(x, y, z)
    }
}

#[derive(Clone, PartialEq)]
struct KernelNode {
    function: sys::CUfunction,
    /// The function declares cluster dimensions (see `LoadedKernel::cluster`).
    cluster: bool,
    grid: Dim3,
    block: Dim3,
    shared_mem: u32,
    args: KernelArgs,
}

impl KernelNode {
    fn node_params(&mut self, pointers: &mut [*mut c_void]) -> sys::CUDA_KERNEL_NODE_PARAMS {
        sys::CUDA_KERNEL_NODE_PARAMS {
            func: self.function,
            gridDimX: self.grid.0,
            gridDimY: self.grid.1,
            gridDimZ: self.grid.2,
            blockDimX: self.block.0,
            blockDimY: self.block.1,
            blockDimZ: self.block.2,
            sharedMemBytes: self.shared_mem,
            kernelParams: pointers.as_mut_ptr(),
            extra: ptr::null_mut(),
            kern: ptr::null_mut(),
            ctx: ptr::null_mut(),
        }
    }
}

// Nearly every node is a kernel: boxing it would cost an allocation per launch.
#[allow(clippy::large_enum_variant)]
enum NodeWork {
    Kernel(KernelNode),
    Empty,
    /// Captured work; the graph node holds a clone of its graph.
    Child(Rc<Captured>),
}

/// Identifies captured work, e.g. a copy's (source, destination, bytes).
pub type CaptureSignature = [u64; 4];

/// Work captured from a stream (a copy, a collective): a child node in graph mode; in direct
/// mode a kept capture is launched as an executable of its own.
struct Captured {
    graph: OwnedGraph,
    /// What identifies its work, when known (two captures with equal signatures do the same
    /// thing).
    signature: Option<CaptureSignature>,
    /// The executable of a kept capture, instantiated on its first direct launch.
    exec: OnceCell<sys::CUgraphExec>,
    /// What must outlive every graph holding this work: NCCL destroys a communicator only once
    /// the graphs that captured its collectives are gone, so they hold it (and drop it last).
    _owner: Option<Arc<dyn Watch>>,
}

impl Captured {
    /// The executable, instantiated on first use.
    fn exec(&self) -> Result<sys::CUgraphExec> {
        if let Some(exec) = self.exec.get() {
            return Ok(*exec);
        }
        let mut exec = ptr::null_mut();
        // SAFETY: the graph is complete and live.
        check(unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, self.graph.0, 0) })?;
        Ok(*self.exec.get_or_init(|| exec))
    }
}

impl Drop for Captured {
    fn drop(&mut self) {
        if let Some(exec) = self.exec.take() {
            // SAFETY: owned only here; an executable still running completes first.
            unsafe { sys::cuGraphExecDestroy(exec) };
        }
    }
}

/// What a cached executable's node currently does, to decide whether it needs an update.
#[derive(Clone)]
#[allow(clippy::large_enum_variant)] // as NodeWork
enum NodeState {
    Kernel(KernelNode),
    Empty,
    /// Held, not just named: the executable contains a clone of its graph.
    Child(Rc<Captured>),
}

impl NodeState {
    fn of(work: &NodeWork) -> NodeState {
        match work {
            NodeWork::Kernel(k) => NodeState::Kernel(k.clone()),
            NodeWork::Empty => NodeState::Empty,
            NodeWork::Child(c) => NodeState::Child(c.clone()),
        }
    }

    fn is_cluster_kernel(&self) -> bool {
        matches!(self, NodeState::Kernel(k) if k.cluster)
    }

    /// Whether a node in this state already does `work` (unknown captures never do).
    fn matches(&self, work: &NodeWork) -> bool {
        match (self, work) {
            (NodeState::Kernel(a), NodeWork::Kernel(b)) => a == b,
            (NodeState::Empty, NodeWork::Empty) => true,
            (NodeState::Child(a), NodeWork::Child(b)) => {
                a.signature.is_some() && a.signature == b.signature
            }
            _ => false,
        }
    }
}

struct Node {
    deps: Vec<u32>,
    work: NodeWork,
}

struct OwnedGraph(sys::CUgraph);

impl Drop for OwnedGraph {
    fn drop(&mut self) {
        // SAFETY: created by the driver and owned only here.
        unsafe { sys::cuGraphDestroy(self.0) };
    }
}

struct CachedExec {
    exec: sys::CUgraphExec,
    /// The graph the executable was instantiated from: its node handles name the executable's
    /// nodes in every later patch (a handle of another graph is an invalid value), so it lives
    /// as long as the executable.
    _graph: OwnedGraph,
    handles: Vec<sys::CUgraphNode>,
    /// What each node does now.
    nodes: Vec<NodeState>,
}

impl Drop for CachedExec {
    fn drop(&mut self) {
        // SAFETY: owned only here; the stream is synchronised before the cache is dropped, and
        // destroying an executable that is still running is allowed (it completes first).
        unsafe { sys::cuGraphExecDestroy(self.exec) };
    }
}

fn check(status: sys::CUresult) -> Result<()> {
    if status == sys::cudaError_enum::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Driver(DriverError(status)))
    }
}

/// The default bound on bytes in flight, in commits of the per-commit byte limit.
const DEFAULT_COMMITS_OF_BYTES_IN_FLIGHT: usize = 4;

/// Default commit limits for a compute capability, from the launch benchmark (see README).
pub fn default_limits(major: u32) -> (usize, usize) {
    match major {
        0..=8 => (20, 400),
        9 => (50, 400),
        _ => (50, 500),
    }
}

/// The byte limits (per commit, in flight) of `config`, whose unset megabyte counts default to
/// `default_mb` per commit and four commits' worth in flight. A count too large for a byte count
/// is no limit (`usize::MAX`), never a smaller one: `<< 20` alone would drop its high bits.
fn byte_limits(config: &Config, default_mb: usize) -> (usize, usize) {
    let mb = config.max_mb_per_buffer.unwrap_or(default_mb);
    let in_flight = config
        .max_mb_in_flight
        .unwrap_or(DEFAULT_COMMITS_OF_BYTES_IN_FLIGHT.saturating_mul(mb));
    (
        mb.saturating_mul(1 << 20),
        in_flight.saturating_mul(1 << 20),
    )
}

/// Records kernel launches on one stream of one device (see the module docs for direct and graph
/// mode).
///
/// A `CommandEncoder` is neither `Send` nor `Sync`, by design: it holds the stream's and the
/// graph executables' raw driver handles and shares captured graphs through `Rc`, and is used
/// from the thread that created it. A program that encodes from several threads creates one
/// encoder per thread (arrays and devices are `Send` and `Sync`; the encoders' streams order
/// only their own work, so work on shared arrays across encoders needs `synchronize`).
///
/// ```compile_fail
/// fn must_be_send<T: Send>() {}
/// must_be_send::<kiln::runtime::CommandEncoder>();
/// ```
pub struct CommandEncoder {
    device: Arc<Device>,
    stream: sys::CUstream,
    capture_stream: sys::CUstream,
    use_graphs: bool,
    /// Direct-mode launches of kernels that wait for their predecessor in their own code
    /// (`launch_dependent`) use programmatic dependent launch: `KILN_DEPENDENT_LAUNCH` on a
    /// GPU of sm_90 or later.
    dependent_launch: bool,
    max_ops: usize,
    max_bytes: usize,
    max_commits_in_flight: usize,
    max_bytes_in_flight: usize,
    tracker: DependencyTracker,
    nodes: Vec<Node>,
    ops_in_batch: usize,
    bytes_in_batch: usize,
    /// Modules the current batch launches, held until it has run.
    kernels: Vec<Arc<LoadedKernel>>,
    /// Work in the current batch whose waits must poll (collectives).
    watches: Vec<Arc<dyn Watch>>,
    timeline: Arc<Timeline>,
    exec_cache: LruCache<String, CachedExec>,
    /// Captures of watched work (collectives) by signature (see `add_watched`).
    kept: LruCache<CaptureSignature, Rc<Captured>>,
    stats: EncoderStats,
    /// Work counters of kernels that claim work at run time (`claim_counter`), made on first
    /// use, and the next one to hand out.
    claim_counters: Option<Array>,
    claim_slots: ClaimSlots,
}

impl CommandEncoder {
    /// An encoder on a new stream of `device`, configured from the environment.
    pub fn new(device: &Arc<Device>) -> Result<CommandEncoder> {
        CommandEncoder::with_config(device, &Config::from_env()?)
    }

    /// An encoder on a new stream of `device`, configured by `config` instead of the
    /// environment (graph mode, commit limits, work in flight, graph cache size).
    ///
    /// An error an earlier encoder of this device could not return (it was dropped with work
    /// that failed) is returned here, once.
    pub fn with_config(device: &Arc<Device>, config: &Config) -> Result<CommandEncoder> {
        if let Some(e) = device.take_error() {
            return Err(e);
        }
        device.bind()?;
        let (ops, mb) = default_limits(device.info().compute_capability.0);
        let (max_bytes, max_bytes_in_flight) = byte_limits(config, mb);
        let mut streams = [ptr::null_mut(); 2];
        for s in &mut streams {
            // SAFETY: the device's context is current.
            check(unsafe {
                sys::cuStreamCreate(s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
            })?;
        }
        Ok(CommandEncoder {
            device: device.clone(),
            stream: streams[0],
            capture_stream: streams[1],
            use_graphs: config.use_cuda_graphs,
            // The kernels are compiled for the GPU's own target, so their waits are there.
            dependent_launch: config.dependent_launch && device.target().arch >= 90,
            max_ops: config.max_ops_per_buffer.unwrap_or(ops),
            max_bytes,
            max_commits_in_flight: config.max_commits_in_flight,
            max_bytes_in_flight,
            tracker: DependencyTracker::new(),
            nodes: Vec::new(),
            ops_in_batch: 0,
            bytes_in_batch: 0,
            kernels: Vec::new(),
            watches: Vec::new(),
            timeline: Timeline::new(),
            exec_cache: LruCache::new(
                NonZeroUsize::new(config.graph_cache_size).unwrap_or(NonZeroUsize::MIN),
            ),
            kept: LruCache::new(
                NonZeroUsize::new(config.graph_cache_size).unwrap_or(NonZeroUsize::MIN),
            ),
            stats: EncoderStats::default(),
            claim_counters: None,
            claim_slots: ClaimSlots::default(),
        })
    }

    /// The device this encoder runs on.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Counters since the encoder was made: launches, commits, graph cache hits and updates.
    pub fn stats(&self) -> EncoderStats {
        self.stats
    }

    /// Whether the encoder builds CUDA graphs (`MLX_USE_CUDA_GRAPHS`) or launches directly.
    pub fn uses_graphs(&self) -> bool {
        self.use_graphs
    }

    /// The commit limits in effect: (ops, bytes).
    pub fn limits(&self) -> (usize, usize) {
        (self.max_ops, self.max_bytes)
    }

    /// The device address of a counter (a u64, zero) for a kernel that claims its work at run
    /// time and leaves the counter zero when it completes (the split-row forward's rows), or
    /// `None`, where the kernel must take its work in a fixed order instead.
    ///
    /// Launches that may run at once get different counters. Only the launches of one commit
    /// can: commits run in stream order, and in direct mode a kernel touches memory only once
    /// the one before it has ended (a dependent launch waits first). The counters are a ring of
    /// one more than a commit's bound on launches (`limits().0`), handed out in turn, and a
    /// commit that has taken every one of them (a concurrent section, which is never split,
    /// can pass the bound) gets `None`. The ring is made (zeroed, by an upload on this stream,
    /// ahead of any kernel that uses it) on first use and lives as long as the encoder, whose
    /// drop waits for its work.
    ///
    /// A launch that takes a counter must not list it among its reads or writes: it is no
    /// dependency between launches, only scratch each leaves as it found it.
    pub(crate) fn claim_counter(&mut self) -> Result<Option<sys::CUdeviceptr>> {
        let slots = self.max_ops.max(1) + 1;
        let Some(slot) = self.claim_slots.take(slots) else {
            return Ok(None);
        };
        if self.claim_counters.is_none() {
            // u64 counters as pairs of f32 zeros.
            let ring =
                Array::from_bytes(self, crate::DType::F32, &[slots * 2], &vec![0u8; slots * 8])?;
            self.claim_counters = Some(ring);
        }
        let ring = self.claim_counters.as_ref().expect("made above");
        Ok(Some(ring.device_ptr() + (slot * 8) as sys::CUdeviceptr))
    }

    /// The bounds on work in flight: (commits, bytes those commits touched).
    pub fn in_flight_limits(&self) -> (usize, usize) {
        (self.max_commits_in_flight, self.max_bytes_in_flight)
    }

    /// Memory for an op's output, written by work encoded next on this encoder: it may reuse
    /// memory this encoder's earlier work released, even while that work is in flight.
    pub(crate) fn alloc(&mut self, bytes: usize) -> Result<Arc<Buffer>> {
        let allocator = self.device.allocator().clone();
        // A graph's nodes are ordered only by their dependencies: reusing memory within the
        // batch being encoded would chain work that could run side by side (and, in a
        // concurrent section, not even be ordered). Direct launches run in stream order.
        let batch = self.timeline.next_seq();
        let reuser = Reuser {
            timeline: &self.timeline,
            through: batch - u64::from(self.use_graphs),
        };
        match allocator.alloc_on(bytes, reuser) {
            Err(Error::OutOfMemory { .. }) => {
                // Memory this encoder's unlaunched work released can reach the driver only
                // once that work has run.
                self.synchronize()?;
                let reuser = Reuser {
                    timeline: &self.timeline,
                    through: self.timeline.next_seq(),
                };
                allocator.alloc_on(bytes, reuser)
            }
            other => other,
        }
    }

    /// The raw stream, for interoperation (work put on it bypasses the encoder's ordering of
    /// uncommitted graph nodes: call `commit` first).
    pub fn stream(&self) -> sys::CUstream {
        self.stream
    }

    fn note_use(&mut self, arrays: &[&Array]) {
        let seq = self.timeline.next_seq();
        for a in arrays {
            self.bytes_in_batch += a.nbytes();
            a.buffer().record_use(&self.timeline, seq);
        }
    }

    fn ids(arrays: &[&Array]) -> Vec<BufferId> {
        arrays.iter().map(|a| a.buffer_id()).collect()
    }

    /// Encodes one kernel launch. Arguments are passed by value; `reads` and `writes` name every
    /// array the kernel touches, for dependencies and lifetimes. An array on another device than
    /// the encoder's is an error; a grid, block or shared-memory size the kernel cannot take is
    /// the driver's error (at once in direct mode, at the commit in graph mode).
    ///
    /// # Safety
    ///
    /// kiln cannot see inside the kernel, so the caller promises what the driver would otherwise
    /// take on trust:
    /// - `args` holds exactly the kernel's parameters, in order, each with the size, alignment
    ///   and meaning the kernel declares (the driver copies each value by the declared size);
    /// - every device address the kernel dereferences lies in an array of `reads` or `writes`
    ///   (or in memory the caller keeps alive and unchanged until the work completes), within
    ///   that array's bytes;
    /// - every array the kernel writes is in `writes`. Graph mode orders nodes by these lists
    ///   alone: a write left out races with the work around it.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch(
        &mut self,
        kernel: &Arc<LoadedKernel>,
        grid: impl Into<Dim3>,
        block: impl Into<Dim3>,
        shared_mem: u32,
        args: KernelArgs,
        reads: &[&Array],
        writes: &[&Array],
    ) -> Result<()> {
        // SAFETY: the caller's promises are `launch_with`'s.
        unsafe { self.launch_with(kernel, grid, block, shared_mem, args, reads, writes, false) }
    }

    /// Encodes one kernel launch, as [`launch`](Self::launch), of a kernel that waits for the
    /// work before it in its own code. In direct mode on sm_90 and later (unless
    /// `KILN_DEPENDENT_LAUNCH=0`) it is launched with programmatic dependent launch: its blocks
    /// may start while the previous kernel on the stream still runs, and run up to that wait,
    /// so that its set-up and the launch itself overlap the previous kernel's end. In graph mode
    /// it is an ordinary kernel node (the wait returns at once).
    ///
    /// # Safety
    ///
    /// As [`launch`](Self::launch)'s, and: every thread of the kernel calls
    /// `kiln_wait_for_previous_grid()` (kiln's prelude) before its first access to global
    /// memory, a read or a write. A kernel that reads before the wait may see the previous
    /// kernel's writes half done; one that writes before it may change what that kernel reads.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch_dependent(
        &mut self,
        kernel: &Arc<LoadedKernel>,
        grid: impl Into<Dim3>,
        block: impl Into<Dim3>,
        shared_mem: u32,
        args: KernelArgs,
        reads: &[&Array],
        writes: &[&Array],
    ) -> Result<()> {
        // SAFETY: the caller's promises are `launch_with`'s with `dependent`.
        unsafe { self.launch_with(kernel, grid, block, shared_mem, args, reads, writes, true) }
    }

    /// `launch` and `launch_dependent`.
    ///
    /// # Safety
    ///
    /// `launch`'s contract; with `dependent`, also `launch_dependent`'s.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_with(
        &mut self,
        kernel: &Arc<LoadedKernel>,
        grid: impl Into<Dim3>,
        block: impl Into<Dim3>,
        shared_mem: u32,
        args: KernelArgs,
        reads: &[&Array],
        writes: &[&Array],
        dependent: bool,
    ) -> Result<()> {
        self.check_device("reads", reads)?;
        self.check_device("writes", writes)?;
        if let Some(why) = args.refused() {
            return Err(Error::InvalidArgument {
                arg: "args",
                reason: why.into(),
            });
        }
        let mut node = KernelNode {
            // The LoadedKernel (and so its module) is retained until the commit completes.
            function: kernel.function.cu_function(),
            cluster: kernel.cluster,
            grid: grid.into(),
            block: block.into(),
            shared_mem,
            args,
        };
        if self.use_graphs {
            let (_, deps) =
                self.tracker
                    .add(NodeKind::Kernel, &Self::ids(reads), &Self::ids(writes));
            self.nodes.push(Node {
                deps,
                work: NodeWork::Kernel(node),
            });
        } else if dependent && self.dependent_launch {
            let mut pointers = node.args.pointers();
            let mut attribute = sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                value: sys::CUlaunchAttributeValue {
                    programmaticStreamSerializationAllowed: 1,
                },
            };
            let config = sys::CUlaunchConfig {
                gridDimX: node.grid.0,
                gridDimY: node.grid.1,
                gridDimZ: node.grid.2,
                blockDimX: node.block.0,
                blockDimY: node.block.1,
                blockDimZ: node.block.2,
                sharedMemBytes: node.shared_mem,
                hStream: self.stream,
                attrs: &mut attribute,
                numAttrs: 1,
            };
            // SAFETY: as cuLaunchKernel's below; `config` and its attribute outlive the call, and
            // the kernel waits for its predecessor before touching memory (the caller's promise).
            check(unsafe {
                sys::cuLaunchKernelEx(
                    &config,
                    node.function,
                    pointers.as_mut_ptr(),
                    ptr::null_mut(),
                )
            })?;
        } else {
            let mut pointers = node.args.pointers();
            // SAFETY: the function belongs to this device's context; the argument pointers are
            // valid for the call, and the driver copies the values before returning.
            check(unsafe {
                sys::cuLaunchKernel(
                    node.function,
                    node.grid.0,
                    node.grid.1,
                    node.grid.2,
                    node.block.0,
                    node.block.1,
                    node.block.2,
                    node.shared_mem,
                    self.stream,
                    pointers.as_mut_ptr(),
                    ptr::null_mut(),
                )
            })?;
        }
        if !self.kernels.last().is_some_and(|k| Arc::ptr_eq(k, kernel)) {
            self.kernels.push(kernel.clone());
        }
        self.note_use(reads);
        self.note_use(writes);
        self.stats.launches += 1;
        self.ops_in_batch += 1;
        self.maybe_commit()
    }

    /// Encodes work that must be stream-captured (a copy, a library call): `work` enqueues it
    /// on the stream it is given. In graph mode that stream is capturing and the result becomes
    /// a child-graph node. An array on another device than the encoder's is an error.
    ///
    /// # Safety
    ///
    /// What `work` enqueues touches only memory of the arrays in `reads` and `writes` (or memory
    /// the caller keeps alive and unchanged until it completes), and writes only arrays of
    /// `writes`; it enqueues only on the stream it is given and does not synchronise it (a
    /// capturing stream cannot be synchronised).
    pub unsafe fn add_captured(
        &mut self,
        reads: &[&Array],
        writes: &[&Array],
        work: impl FnOnce(sys::CUstream) -> Result<()>,
    ) -> Result<()> {
        self.check_device("reads", reads)?;
        self.check_device("writes", writes)?;
        self.add_captured_with(reads, writes, None, work)
    }

    /// [`Error::DeviceMismatch`] naming `arg` unless every array lives on this encoder's device.
    fn check_device(&self, arg: &'static str, arrays: &[&Array]) -> Result<()> {
        for a in arrays {
            if !Arc::ptr_eq(a.device(), &self.device) {
                return Err(Error::DeviceMismatch {
                    arg,
                    expected: self.device.ordinal(),
                    got: a.device().ordinal(),
                });
            }
        }
        Ok(())
    }

    fn add_captured_with(
        &mut self,
        reads: &[&Array],
        writes: &[&Array],
        signature: Option<CaptureSignature>,
        work: impl FnOnce(sys::CUstream) -> Result<()>,
    ) -> Result<()> {
        if self.use_graphs {
            let graph = self.capture(work)?;
            let captured = Captured {
                graph,
                signature,
                exec: OnceCell::new(),
                _owner: None,
            };
            self.add_child(reads, writes, Rc::new(captured));
        } else {
            work(self.stream)?;
        }
        self.finish_captured(reads, writes)
    }

    /// Runs `work` on the capture stream and returns what it enqueued as a graph.
    fn capture(&mut self, work: impl FnOnce(sys::CUstream) -> Result<()>) -> Result<OwnedGraph> {
        self.device.bind()?;
        // SAFETY: capture_stream is ours and idle (it is only ever used for capture).
        check(unsafe {
            sys::cuStreamBeginCapture_v2(
                self.capture_stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        })?;
        let result = work(self.capture_stream);
        let mut graph = ptr::null_mut();
        // SAFETY: ends the capture begun above, whatever `work` did.
        let ended = check(unsafe { sys::cuStreamEndCapture(self.capture_stream, &mut graph) });
        let graph = OwnedGraph(graph);
        result?;
        ended?;
        Ok(graph)
    }

    fn add_child(&mut self, reads: &[&Array], writes: &[&Array], captured: Rc<Captured>) {
        let (_, deps) = self
            .tracker
            .add(NodeKind::Child, &Self::ids(reads), &Self::ids(writes));
        self.nodes.push(Node {
            deps,
            work: NodeWork::Child(captured),
        });
    }

    fn finish_captured(&mut self, reads: &[&Array], writes: &[&Array]) -> Result<()> {
        self.note_use(reads);
        self.note_use(writes);
        self.ops_in_batch += 1;
        self.maybe_commit()
    }

    /// Captured work with a known signature whose completion `watch` oversees (see
    /// [`Watch`]): the collectives.
    ///
    /// The capture is kept, by signature, so that the same work encoded again is neither
    /// captured nor issued again: in graph mode the kept graph becomes the child node, in
    /// direct mode its executable is launched on the stream. For a collective this takes
    /// NCCL's host side (a thread per call on a non-blocking communicator) out of every call
    /// but the first. `watch.usable()` is asked before kept work runs again.
    pub(crate) fn add_watched(
        &mut self,
        reads: &[&Array],
        writes: &[&Array],
        signature: CaptureSignature,
        watch: &Arc<dyn Watch>,
        work: impl FnOnce(sys::CUstream) -> Result<()>,
    ) -> Result<()> {
        let captured = match self.kept.get(&signature) {
            Some(kept) => {
                watch.usable()?;
                kept.clone()
            }
            None => {
                let graph = self.capture(work)?;
                let captured = Rc::new(Captured {
                    graph,
                    signature: Some(signature),
                    exec: OnceCell::new(),
                    _owner: Some(watch.clone()),
                });
                self.kept.put(signature, captured.clone());
                captured
            }
        };
        if !self.watches.iter().any(|w| Arc::ptr_eq(w, watch)) {
            self.watches.push(watch.clone());
        }
        if self.use_graphs {
            self.add_child(reads, writes, captured);
        } else {
            let exec = captured.exec()?;
            self.device.bind()?;
            // SAFETY: the executable and the stream are live; `captured` stays referenced by
            // the kept cache or is dropped only after its launch has been enqueued (the driver
            // completes a launched executable before destroying it).
            check(unsafe { sys::cuGraphLaunch(exec, self.stream) })?;
        }
        self.finish_captured(reads, writes)
    }

    /// Copies `src` into `dst` (contiguous, same dtype and size) as a captured memcpy.
    pub fn copy_into(&mut self, src: &Array, dst: &Array) -> Result<()> {
        if !src.is_contiguous()
            || !dst.is_contiguous()
            || src.nbytes() != dst.nbytes()
            || src.dtype() != dst.dtype()
        {
            return Err(Error::InvalidArgument {
                arg: "dst",
                reason: format!(
                    "copy_into needs contiguous arrays of one dtype and size: {src:?} -> {dst:?}"
                ),
            });
        }
        let (from, to, bytes) = (src.device_ptr(), dst.device_ptr(), src.nbytes());
        // Word 3 tells a copy from a collective (whose word 3 is an element count).
        let signature = [from, to, bytes as u64, u64::MAX];
        self.add_captured_with(&[src], &[dst], Some(signature), |stream| {
            // SAFETY: both ranges lie inside live allocations of `bytes` bytes.
            check(unsafe { sys::cuMemcpyDtoDAsync_v2(to, from, bytes, stream) })
        })
    }

    /// Starts a section whose launches do not depend on each other (graph mode only).
    pub fn begin_concurrent(&mut self) {
        if self.use_graphs {
            self.tracker.begin_concurrent();
        }
    }

    /// Ends the section: an empty node joins its launches.
    pub fn end_concurrent(&mut self) -> Result<()> {
        if let Some((_, deps)) = self.tracker.end_concurrent() {
            self.nodes.push(Node {
                deps,
                work: NodeWork::Empty,
            });
        }
        self.maybe_commit()
    }

    fn maybe_commit(&mut self) -> Result<()> {
        if self.tracker.in_concurrent_section() {
            return Ok(());
        }
        if self.ops_in_batch >= self.max_ops || self.bytes_in_batch > self.max_bytes {
            self.commit()?;
        }
        Ok(())
    }

    /// Uploads host bytes into `dst`, a fresh contiguous array, on the stream. No commit is
    /// needed: encoded but uncommitted work cannot refer to a buffer allocated after it, and work
    /// encoded later runs after the copy in stream order.
    pub(crate) fn upload(&mut self, dst: &Array, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        self.drain_watched()?;
        self.device.bind()?;
        // SAFETY: dst's range is live and `data.len()` bytes long; for pageable host memory the
        // driver stages the data before returning, so `data` may be dropped afterwards.
        check(unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst.device_ptr(),
                data.as_ptr() as *const c_void,
                data.len(),
                self.stream,
            )
        })?;
        dst.buffer()
            .record_use(&self.timeline, self.timeline.next_seq());
        self.bytes_in_batch += data.len();
        Ok(())
    }

    /// Waits for all work, then copies `src` (contiguous) to the host.
    pub(crate) fn download(&mut self, src: &Array) -> Result<Vec<u8>> {
        let mut out = vec![0u8; src.nbytes()];
        self.commit()?;
        self.drain_watched()?;
        if !out.is_empty() {
            self.device.bind()?;
            // SAFETY: src's range is live; `out` has room for it and outlives the synchronise.
            check(unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    out.as_mut_ptr() as *mut c_void,
                    src.device_ptr(),
                    out.len(),
                    self.stream,
                )
            })?;
        }
        self.synchronize()?;
        Ok(out)
    }

    /// Waits (polling, with the watches' deadlines) for work that waits on other processes or
    /// GPUs before a copy with pageable host memory: the driver makes such a copy wait for the
    /// stream inside the call, where a collective whose peer is stuck would hold it forever, and
    /// with several GPUs in one process the blocked call can keep the peer's own work from
    /// being launched at all.
    fn drain_watched(&mut self) -> Result<()> {
        if !self.watches.is_empty() || self.timeline.watched_in_flight() {
            self.synchronize()?;
        }
        Ok(())
    }

    /// Launches everything encoded so far (graph mode: as one graph).
    pub fn commit(&mut self) -> Result<()> {
        let span = tracing::debug_span!(
            "kiln.commit",
            nodes = self.nodes.len(),
            ops = self.ops_in_batch
        );
        let _enter = span.enter();
        if self.tracker.in_concurrent_section() {
            self.end_concurrent_for_commit();
        }
        let result = if self.nodes.is_empty() {
            Ok(())
        } else {
            self.launch_graph()
        };
        self.nodes.clear();
        self.tracker.clear();
        self.ops_in_batch = 0;
        self.claim_slots.new_commit();
        let bytes = std::mem::take(&mut self.bytes_in_batch);
        let kernels = std::mem::take(&mut self.kernels);
        let watches = std::mem::take(&mut self.watches);
        result?;
        if !kernels.is_empty() || bytes > 0 || !watches.is_empty() {
            self.device.bind()?;
            self.timeline.record(self.stream, bytes, kernels, watches)?;
        }
        self.throttle()
    }

    /// Waits for the oldest commits until those in flight are within the bounds (never for the
    /// one just launched).
    fn throttle(&mut self) -> Result<()> {
        self.timeline.poll()?;
        let mut waited = false;
        loop {
            let (commits, bytes) = self.timeline.in_flight();
            let over = commits > self.max_commits_in_flight || bytes > self.max_bytes_in_flight;
            if !over || commits <= 1 || !self.timeline.wait_oldest()? {
                break;
            }
            waited = true;
        }
        self.stats.throttled_commits += u64::from(waited);
        Ok(())
    }

    fn end_concurrent_for_commit(&mut self) {
        if let Some((_, deps)) = self.tracker.end_concurrent() {
            self.nodes.push(Node {
                deps,
                work: NodeWork::Empty,
            });
        }
    }

    /// Commits, waits for the stream, and releases every buffer the GPU was using. Also returns,
    /// once, an error another encoder of this device met when it was dropped.
    pub fn synchronize(&mut self) -> Result<()> {
        self.commit()?;
        self.device.bind()?;
        // Commit by commit first: a commit with collectives is waited for by polling, so that
        // a peer that never comes is an error, not a hang.
        while self.timeline.wait_oldest()? {}
        // SAFETY: the stream is live.
        check(unsafe { sys::cuStreamSynchronize(self.stream) })?;
        self.timeline.poll()?;
        // What another encoder of this device could not return when it was dropped.
        match self.device.take_error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// How many commits may still be running on the GPU.
    pub fn commits_in_flight(&self) -> usize {
        self.timeline.in_flight().0
    }

    fn launch_graph(&mut self) -> Result<()> {
        self.device.bind()?;
        let key = self.tracker.topology_key().to_string();
        let mut launched = false;
        if let Some(cached) = self.exec_cache.get_mut(&key) {
            self.stats.exec_cache_hits += 1;
            let fresh = update_cached(cached, &mut self.nodes, &mut self.stats)?;
            if let Some(fresh) = fresh {
                *cached = fresh;
            }
            // SAFETY: the executable and stream are live.
            check(unsafe { sys::cuGraphLaunch(cached.exec, self.stream) })?;
            launched = true;
        }
        if !launched {
            let fresh = instantiate(&mut self.nodes)?;
            self.stats.instantiations += 1;
            // SAFETY: as above.
            check(unsafe { sys::cuGraphLaunch(fresh.exec, self.stream) })?;
            if self.exec_cache.push(key, fresh).is_some() {
                self.stats.evictions += 1;
            }
        }
        self.stats.graph_commits += 1;
        Ok(())
    }
}

/// How one node of a cached executable compares with the node a new batch asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NodeChange {
    Same,
    /// A kernel node with the same function, and so the same parameter layout: new grid, block,
    /// shared memory or argument values, which `cuGraphExecKernelNodeSetParams` may set.
    KernelParams,
    /// Anything else: another function, an unknown or changed capture.
    Other,
}

impl NodeState {
    fn change_to(&self, work: &NodeWork) -> NodeChange {
        if self.matches(work) {
            return NodeChange::Same;
        }
        match (self, work) {
            (NodeState::Kernel(old), NodeWork::Kernel(new))
                if old.function == new.function && old.args.same_layout(&new.args) =>
            {
                NodeChange::KernelParams
            }
            _ => NodeChange::Other,
        }
    }
}

/// How a cached executable is brought up to date with a batch of the same topology.
#[derive(Debug, PartialEq, Eq)]
enum Refresh {
    /// Every node already does what the batch asks: launch as is.
    AsIs,
    /// Only these kernel nodes changed, each keeping its function: set their parameters.
    Patch(Vec<usize>),
    /// A change a node patch cannot make: `cuGraphExecUpdate` with the whole graph (and
    /// re-instantiation if the driver refuses it).
    Whole,
    /// A new executable from the batch's graph.
    Reinstantiate,
}

/// The refresh for a change no node patch makes (or one the driver refused): a whole-graph
/// update, unless a cluster kernel is in the old graph or the new one. Those are instantiated
/// afresh: on an H100, `cuGraphExecUpdate` accepted a graph whose cluster kernel node became
/// another kernel, and later launches computed garbage.
fn whole_refresh(clusters: bool) -> Refresh {
    if clusters {
        Refresh::Reinstantiate
    } else {
        Refresh::Whole
    }
}

/// Decides the refresh from what kiln knows of each node, so that no driver call is made that
/// the driver would refuse. `clusters`: a cluster kernel is in the cached graph or the batch.
fn plan_refresh(changes: impl IntoIterator<Item = NodeChange>, clusters: bool) -> Refresh {
    let mut patch = Vec::new();
    for (i, change) in changes.into_iter().enumerate() {
        match change {
            NodeChange::Same => {}
            NodeChange::KernelParams => patch.push(i),
            NodeChange::Other => return whole_refresh(clusters),
        }
    }
    if patch.is_empty() {
        Refresh::AsIs
    } else {
        Refresh::Patch(patch)
    }
}

/// Brings a cached executable up to date with `nodes` (same topology). Returns a replacement
/// when the executable had to be re-instantiated.
fn update_cached(
    cached: &mut CachedExec,
    nodes: &mut [Node],
    stats: &mut EncoderStats,
) -> Result<Option<CachedExec>> {
    let clusters = cached.nodes.iter().any(NodeState::is_cluster_kernel)
        || nodes
            .iter()
            .any(|n| matches!(&n.work, NodeWork::Kernel(k) if k.cluster));
    let refresh = plan_refresh(
        cached
            .nodes
            .iter()
            .zip(nodes.iter())
            .map(|(state, node)| state.change_to(&node.work)),
        clusters,
    );
    if tracing::enabled!(tracing::Level::DEBUG) {
        if let Refresh::Patch(changed) = &refresh {
            let i = changed[0];
            tracing::debug!(
                "patching {} of {} nodes; node {i}: {}",
                changed.len(),
                nodes.len(),
                describe_change(&cached.nodes[i], &nodes[i].work)
            );
        }
    }
    let refresh = match refresh {
        Refresh::AsIs => {
            stats.exec_reuses += 1;
            return Ok(None);
        }
        Refresh::Patch(changed) => {
            if patch_kernel_nodes(cached, nodes, &changed) {
                stats.updates += 1;
                return Ok(None);
            }
            stats.refused_patches += 1;
            whole_refresh(clusters)
        }
        other => other,
    };
    // Whole-graph update (a refusal means re-instantiation), or re-instantiation at once.
    let (graph, handles) = build_graph(nodes)?;
    if refresh == Refresh::Reinstantiate {
        let fresh = instantiate_from(graph, handles, nodes)?;
        stats.instantiations += 1;
        stats.reinstantiations += 1;
        return Ok(Some(fresh));
    }
    // SAFETY: a plain C struct the call fills in.
    let mut info: sys::CUgraphExecUpdateResultInfo = unsafe { std::mem::zeroed() };
    // SAFETY: both handles are live; info receives the result.
    let status = unsafe { sys::cuGraphExecUpdate_v2(cached.exec, graph.0, &mut info) };
    if status == sys::cudaError_enum::CUDA_SUCCESS {
        // The executable still names its nodes by the graph it was instantiated from: keep
        // that graph's handles (the update's graph is dropped here).
        cached.nodes = nodes.iter().map(|n| NodeState::of(&n.work)).collect();
        stats.updates += 1;
        return Ok(None);
    }
    let fresh = instantiate_from(graph, handles, nodes)?;
    stats.instantiations += 1;
    stats.reinstantiations += 1;
    Ok(Some(fresh))
}

/// What differs between a kernel node and its new parameters, for the debug log.
fn describe_change(old: &NodeState, new: &NodeWork) -> String {
    let (NodeState::Kernel(a), NodeWork::Kernel(b)) = (old, new) else {
        return "not a kernel".into();
    };
    let mut out = Vec::new();
    if (a.grid, a.block, a.shared_mem) != (b.grid, b.block, b.shared_mem) {
        out.push(format!(
            "launch {:?} {:?} {} -> {:?} {:?} {}",
            a.grid, a.block, a.shared_mem, b.grid, b.block, b.shared_mem
        ));
    }
    for (i, (x, y)) in a.args.values().zip(b.args.values()).enumerate() {
        if x != y {
            out.push(format!("argument {i}: {x:02x?} -> {y:02x?}"));
        }
    }
    out.join("; ")
}

/// Sets the parameters of the kernel nodes `changed` (each keeps its function). Returns false,
/// after a warning, if the driver refused one anyway: the caller then updates the whole graph.
fn patch_kernel_nodes(cached: &mut CachedExec, nodes: &mut [Node], changed: &[usize]) -> bool {
    for &i in changed {
        let NodeWork::Kernel(k) = &mut nodes[i].work else {
            return false;
        };
        let mut pointers = k.args.pointers();
        let params = k.node_params(&mut pointers);
        // SAFETY: the handle is a kernel node of the graph this executable was instantiated
        // from, and the node keeps its function.
        let status = unsafe {
            sys::cuGraphExecKernelNodeSetParams_v2(cached.exec, cached.handles[i], &params)
        };
        if status != sys::cudaError_enum::CUDA_SUCCESS {
            tracing::warn!("cuGraphExecKernelNodeSetParams refused node {i}: {status:?}");
            return false;
        }
        cached.nodes[i] = NodeState::Kernel(k.clone());
    }
    true
}

fn instantiate(nodes: &mut [Node]) -> Result<CachedExec> {
    let (graph, handles) = build_graph(nodes)?;
    instantiate_from(graph, handles, nodes)
}

fn instantiate_from(
    graph: OwnedGraph,
    handles: Vec<sys::CUgraphNode>,
    nodes: &[Node],
) -> Result<CachedExec> {
    let mut exec = ptr::null_mut();
    // SAFETY: the graph is complete and live.
    check(unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph.0, 0) })?;
    Ok(CachedExec {
        exec,
        _graph: graph,
        handles,
        nodes: nodes.iter().map(|n| NodeState::of(&n.work)).collect(),
    })
}

fn build_graph(nodes: &mut [Node]) -> Result<(OwnedGraph, Vec<sys::CUgraphNode>)> {
    let mut raw = ptr::null_mut();
    // SAFETY: creates an empty graph.
    check(unsafe { sys::cuGraphCreate(&mut raw, 0) })?;
    let graph = OwnedGraph(raw);
    let mut handles: Vec<sys::CUgraphNode> = Vec::with_capacity(nodes.len());
    let mut deps: Vec<sys::CUgraphNode> = Vec::new();
    for node in nodes.iter_mut() {
        deps.clear();
        deps.extend(node.deps.iter().map(|&d| handles[d as usize]));
        let mut handle = ptr::null_mut();
        // SAFETY (all three): the graph and dependency handles are live; the driver copies
        // kernel parameters and clones child graphs when the node is added.
        let status = match &mut node.work {
            NodeWork::Kernel(k) => {
                let mut pointers = k.args.pointers();
                let params = k.node_params(&mut pointers);
                unsafe {
                    sys::cuGraphAddKernelNode_v2(
                        &mut handle,
                        graph.0,
                        deps.as_ptr(),
                        deps.len(),
                        &params,
                    )
                }
            }
            NodeWork::Empty => unsafe {
                sys::cuGraphAddEmptyNode(&mut handle, graph.0, deps.as_ptr(), deps.len())
            },
            NodeWork::Child(child) => unsafe {
                sys::cuGraphAddChildGraphNode(
                    &mut handle,
                    graph.0,
                    deps.as_ptr(),
                    deps.len(),
                    child.graph.0,
                )
            },
        };
        check(status)?;
        handles.push(handle);
    }
    Ok((graph, handles))
}

impl Drop for CommandEncoder {
    fn drop(&mut self) {
        // Unfinished work runs to the end; an error it (or its commit) meets has no caller
        // here, so the device keeps it for the next call that can return it.
        if let Err(e) = self.synchronize() {
            self.device.record_error(e);
        }
        self.timeline.close();
        self.exec_cache.clear();
        self.kept.clear();
        // SAFETY: the streams are ours and idle.
        unsafe {
            sys::cuStreamDestroy_v2(self.stream);
            sys::cuStreamDestroy_v2(self.capture_stream);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(function: usize, values: &[u64]) -> KernelNode {
        let mut args = KernelArgs::new();
        for v in values {
            args.push(*v);
        }
        KernelNode {
            function: function as sys::CUfunction,
            cluster: false,
            grid: Dim3(1, 1, 1),
            block: Dim3(32, 1, 1),
            shared_mem: 0,
            args,
        }
    }

    #[test]
    fn no_two_launches_of_a_commit_share_a_claim_counter() {
        let mut ring = ClaimSlots::default();
        // A commit of more claiming launches than slots (a concurrent section).
        let taken: Vec<_> = (0..5).map(|_| ring.take(3)).collect();
        assert_eq!(taken, [Some(0), Some(1), Some(2), None, None]);
        // The next commit goes on round the ring.
        ring.new_commit();
        assert_eq!(ring.take(3), Some(0));
        assert_eq!(ring.take(3), Some(1));
        ring.new_commit();
        assert_eq!(ring.take(3), Some(2));
        assert_eq!(ring.take(3), Some(0));
    }

    #[test]
    fn node_changes() {
        let old = NodeState::Kernel(kernel(8, &[1, 2]));
        let same = NodeWork::Kernel(kernel(8, &[1, 2]));
        assert_eq!(old.change_to(&same), NodeChange::Same);
        let moved = NodeWork::Kernel(kernel(8, &[1, 3]));
        assert_eq!(old.change_to(&moved), NodeChange::KernelParams);
        let mut regrid = kernel(8, &[1, 2]);
        regrid.grid = Dim3(4, 1, 1);
        regrid.shared_mem = 1024;
        assert_eq!(
            old.change_to(&NodeWork::Kernel(regrid)),
            NodeChange::KernelParams
        );
        // Another function, or another parameter layout, is no node patch.
        let other = NodeWork::Kernel(kernel(16, &[1, 2]));
        assert_eq!(old.change_to(&other), NodeChange::Other);
        let longer = NodeWork::Kernel(kernel(8, &[1, 2, 3]));
        assert_eq!(old.change_to(&longer), NodeChange::Other);
        assert_eq!(old.change_to(&NodeWork::Empty), NodeChange::Other);
        assert_eq!(
            NodeState::Empty.change_to(&NodeWork::Empty),
            NodeChange::Same
        );
    }

    #[test]
    fn byte_limits_saturate_instead_of_wrapping() {
        let mut config = Config::from_lookup(|_| None).unwrap();
        assert_eq!(byte_limits(&config, 400), (400 << 20, 1600 << 20));
        config.max_mb_per_buffer = Some(100);
        config.max_mb_in_flight = Some(64);
        assert_eq!(byte_limits(&config, 400), (100 << 20, 64 << 20));
        // `1 << 44` megabytes is 2^64 bytes: `<< 20` wrapped it to a limit of 0 (a commit after
        // every launch), and four commits of `usize::MAX / 2` overflowed.
        config.max_mb_per_buffer = Some(1 << 44);
        config.max_mb_in_flight = None;
        assert_eq!(byte_limits(&config, 400), (usize::MAX, usize::MAX));
        config.max_mb_per_buffer = Some(usize::MAX / 2);
        assert_eq!(byte_limits(&config, 400), (usize::MAX, usize::MAX));
    }

    #[test]
    fn refresh_decisions() {
        use NodeChange::*;
        for clusters in [false, true] {
            assert_eq!(plan_refresh([Same, Same], clusters), Refresh::AsIs);
            assert_eq!(plan_refresh([], clusters), Refresh::AsIs);
            // Kernel parameters are patched node by node, clusters or not.
            assert_eq!(
                plan_refresh([Same, KernelParams, Same, KernelParams], clusters),
                Refresh::Patch(vec![1, 3])
            );
        }
        assert_eq!(
            plan_refresh([KernelParams, Other, Same], false),
            Refresh::Whole
        );
        // A graph with a cluster kernel is never updated whole: it is instantiated afresh.
        assert_eq!(
            plan_refresh([KernelParams, Other, Same], true),
            Refresh::Reinstantiate
        );
        assert_eq!(whole_refresh(false), Refresh::Whole);
        assert_eq!(whole_refresh(true), Refresh::Reinstantiate);
    }
}
