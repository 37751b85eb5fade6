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
//! Buffers a commit uses stay alive until an event recorded after it has completed; they are
//! released per commit, never by a host callback per op.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::num::NonZeroUsize;
use std::ptr;
use std::sync::Arc;

use cudarc::driver::{sys, DriverError};
use lru::LruCache;

use super::allocator::Buffer;
use super::args::KernelArgs;
use super::array::Array;
use super::deps::{BufferId, DependencyTracker, NodeKind};
use super::device::Device;
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
    /// A captured graph, owned here until the commit (the graph node holds a clone), and what
    /// identifies its work, when known (two captures with equal signatures do the same thing).
    Child(OwnedGraph, Option<CaptureSignature>),
}

/// Identifies captured work, e.g. a copy's (source, destination, bytes).
pub type CaptureSignature = [u64; 4];

/// What a cached executable's node currently does, to decide whether it needs an update.
#[derive(Clone, PartialEq)]
#[allow(clippy::large_enum_variant)] // as NodeWork
enum NodeState {
    Kernel(KernelNode),
    Empty,
    Child(Option<CaptureSignature>),
}

impl NodeState {
    fn of(work: &NodeWork) -> NodeState {
        match work {
            NodeWork::Kernel(k) => NodeState::Kernel(k.clone()),
            NodeWork::Empty => NodeState::Empty,
            NodeWork::Child(_, sig) => NodeState::Child(*sig),
        }
    }

    /// Whether a node in this state already does `work` (unknown captures never do).
    fn matches(&self, work: &NodeWork) -> bool {
        match (self, work) {
            (NodeState::Kernel(a), NodeWork::Kernel(b)) => a == b,
            (NodeState::Empty, NodeWork::Empty) => true,
            (NodeState::Child(Some(a)), NodeWork::Child(_, Some(b))) => a == b,
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
    /// The graph the executable was made from: its node handles address nodes for updates.
    graph: OwnedGraph,
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

/// A commit the GPU may still be running, with what it uses: held (never read) until its event
/// completes, then dropped, which returns the buffers to the allocator.
struct InFlight {
    event: sys::CUevent,
    _buffers: Vec<Arc<Buffer>>,
    _kernels: Vec<Arc<LoadedKernel>>,
}

fn check(status: sys::CUresult) -> Result<()> {
    if status == sys::cudaError_enum::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Driver(DriverError(status)))
    }
}

/// Default commit limits for a compute capability, from the launch benchmark (see README).
pub fn default_limits(major: u32) -> (usize, usize) {
    match major {
        0..=8 => (20, 400),
        9 => (50, 400),
        _ => (50, 500),
    }
}

pub struct CommandEncoder {
    device: Arc<Device>,
    stream: sys::CUstream,
    capture_stream: sys::CUstream,
    use_graphs: bool,
    max_ops: usize,
    max_bytes: usize,
    tracker: DependencyTracker,
    nodes: Vec<Node>,
    ops_in_batch: usize,
    bytes_in_batch: usize,
    retained: Vec<Arc<Buffer>>,
    kernels: Vec<Arc<LoadedKernel>>,
    in_flight: VecDeque<InFlight>,
    free_events: Vec<sys::CUevent>,
    exec_cache: LruCache<String, CachedExec>,
    stats: EncoderStats,
}

impl CommandEncoder {
    /// An encoder on a new stream of `device`, configured from the environment.
    pub fn new(device: &Arc<Device>) -> Result<CommandEncoder> {
        CommandEncoder::with_config(device, &Config::from_env()?)
    }

    pub fn with_config(device: &Arc<Device>, config: &Config) -> Result<CommandEncoder> {
        device.bind()?;
        let (ops, mb) = default_limits(device.info().compute_capability.0);
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
            max_ops: config.max_ops_per_buffer.unwrap_or(ops),
            max_bytes: config.max_mb_per_buffer.unwrap_or(mb) << 20,
            tracker: DependencyTracker::new(),
            nodes: Vec::new(),
            ops_in_batch: 0,
            bytes_in_batch: 0,
            retained: Vec::new(),
            kernels: Vec::new(),
            in_flight: VecDeque::new(),
            free_events: Vec::new(),
            exec_cache: LruCache::new(
                NonZeroUsize::new(config.graph_cache_size).unwrap_or(NonZeroUsize::MIN),
            ),
            stats: EncoderStats::default(),
        })
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    pub fn stats(&self) -> EncoderStats {
        self.stats
    }

    pub fn uses_graphs(&self) -> bool {
        self.use_graphs
    }

    /// The commit limits in effect: (ops, bytes).
    pub fn limits(&self) -> (usize, usize) {
        (self.max_ops, self.max_bytes)
    }

    /// The raw stream, for interoperation (work put on it bypasses the encoder's ordering of
    /// uncommitted graph nodes: call `commit` first).
    pub fn stream(&self) -> sys::CUstream {
        self.stream
    }

    fn note_use(&mut self, arrays: &[&Array]) {
        for a in arrays {
            self.bytes_in_batch += a.nbytes();
            // Chains touch the same few buffers again and again: skip recent repeats.
            let recent = self.retained.iter().rev().take(4);
            if !recent.into_iter().any(|b| Arc::ptr_eq(b, a.buffer())) {
                self.retained.push(a.buffer().clone());
            }
        }
    }

    fn ids(arrays: &[&Array]) -> Vec<BufferId> {
        arrays.iter().map(|a| a.buffer_id()).collect()
    }

    /// Encodes one kernel launch. Arguments are passed by value; `reads` and `writes` name every
    /// array the kernel touches, for dependencies and lifetimes.
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &mut self,
        kernel: &Arc<LoadedKernel>,
        grid: impl Into<Dim3>,
        block: impl Into<Dim3>,
        shared_mem: u32,
        args: KernelArgs,
        reads: &[&Array],
        writes: &[&Array],
    ) -> Result<()> {
        let mut node = KernelNode {
            // The LoadedKernel (and so its module) is retained until the commit completes.
            function: kernel.function.cu_function(),
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
    /// a child-graph node.
    pub fn add_captured(
        &mut self,
        reads: &[&Array],
        writes: &[&Array],
        work: impl FnOnce(sys::CUstream) -> Result<()>,
    ) -> Result<()> {
        self.add_captured_with(reads, writes, None, work)
    }

    fn add_captured_with(
        &mut self,
        reads: &[&Array],
        writes: &[&Array],
        signature: Option<CaptureSignature>,
        work: impl FnOnce(sys::CUstream) -> Result<()>,
    ) -> Result<()> {
        if self.use_graphs {
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
            let (_, deps) =
                self.tracker
                    .add(NodeKind::Child, &Self::ids(reads), &Self::ids(writes));
            self.nodes.push(Node {
                deps,
                work: NodeWork::Child(graph, signature),
            });
        } else {
            work(self.stream)?;
        }
        self.note_use(reads);
        self.note_use(writes);
        self.ops_in_batch += 1;
        self.maybe_commit()
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
        let signature = [from, to, bytes as u64, 0];
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
        self.retained.push(dst.buffer().clone());
        Ok(())
    }

    /// Waits for all work, then copies `src` (contiguous) to the host.
    pub(crate) fn download(&mut self, src: &Array) -> Result<Vec<u8>> {
        let mut out = vec![0u8; src.nbytes()];
        self.commit()?;
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
        self.bytes_in_batch = 0;
        result?;
        self.release_completed()?;
        if self.retained.is_empty() && self.kernels.is_empty() {
            return Ok(());
        }
        let event = match self.free_events.pop() {
            Some(e) => e,
            None => {
                let mut e = ptr::null_mut();
                // SAFETY: the context is current (bound by the launch path).
                check(unsafe {
                    sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
                })?;
                e
            }
        };
        // SAFETY: event and stream are live.
        check(unsafe { sys::cuEventRecord(event, self.stream) })?;
        self.in_flight.push_back(InFlight {
            event,
            _buffers: std::mem::take(&mut self.retained),
            _kernels: std::mem::take(&mut self.kernels),
        });
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

    /// Commits, waits for the stream, and releases every buffer the GPU was using.
    pub fn synchronize(&mut self) -> Result<()> {
        self.commit()?;
        self.device.bind()?;
        // SAFETY: the stream is live.
        check(unsafe { sys::cuStreamSynchronize(self.stream) })?;
        for f in self.in_flight.drain(..) {
            self.free_events.push(f.event);
        }
        Ok(())
    }

    /// Drops the buffers of every commit the GPU has finished.
    fn release_completed(&mut self) -> Result<()> {
        while let Some(front) = self.in_flight.front() {
            // SAFETY: the event is live.
            let status = unsafe { sys::cuEventQuery(front.event) };
            if status == sys::cudaError_enum::CUDA_ERROR_NOT_READY {
                break;
            }
            check(status)?;
            let done = self.in_flight.pop_front().expect("front exists");
            self.free_events.push(done.event);
        }
        Ok(())
    }

    /// How many commits may still be running on the GPU.
    pub fn commits_in_flight(&self) -> usize {
        self.in_flight.len()
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

/// Brings a cached executable up to date with `nodes` (same topology). Returns a replacement
/// when the executable had to be re-instantiated.
fn update_cached(
    cached: &mut CachedExec,
    nodes: &mut [Node],
    stats: &mut EncoderStats,
) -> Result<Option<CachedExec>> {
    let changed: Vec<usize> = (0..nodes.len())
        .filter(|&i| !cached.nodes[i].matches(&nodes[i].work))
        .collect();
    if changed.is_empty() {
        stats.exec_reuses += 1;
        return Ok(None);
    }
    // Kernel nodes whose function is unchanged can be patched one by one.
    let patchable = changed
        .iter()
        .all(|&i| match (&cached.nodes[i], &nodes[i].work) {
            (NodeState::Kernel(old), NodeWork::Kernel(new)) => old.function == new.function,
            _ => false,
        });
    if patchable && patch_kernel_nodes(cached, nodes, &changed) {
        stats.updates += 1;
        return Ok(None);
    }
    // Whole-graph update; a refusal means re-instantiation.
    let (graph, handles) = build_graph(nodes)?;
    // SAFETY: a plain C struct the call fills in.
    let mut info: sys::CUgraphExecUpdateResultInfo = unsafe { std::mem::zeroed() };
    // SAFETY: both handles are live; info receives the result.
    let status = unsafe { sys::cuGraphExecUpdate_v2(cached.exec, graph.0, &mut info) };
    if status == sys::cudaError_enum::CUDA_SUCCESS {
        cached.graph = graph;
        cached.handles = handles;
        cached.nodes = nodes.iter().map(|n| NodeState::of(&n.work)).collect();
        stats.updates += 1;
        return Ok(None);
    }
    let fresh = instantiate_from(graph, handles, nodes)?;
    stats.instantiations += 1;
    stats.reinstantiations += 1;
    Ok(Some(fresh))
}

/// Sets the parameters of the kernel nodes `changed`; false if the driver refused one.
fn patch_kernel_nodes(cached: &mut CachedExec, nodes: &mut [Node], changed: &[usize]) -> bool {
    for &i in changed {
        let NodeWork::Kernel(k) = &mut nodes[i].work else {
            return false;
        };
        let mut pointers = k.args.pointers();
        let params = k.node_params(&mut pointers);
        // SAFETY: the handle is a kernel node of the graph this executable came from.
        let status = unsafe {
            sys::cuGraphExecKernelNodeSetParams_v2(cached.exec, cached.handles[i], &params)
        };
        if status != sys::cudaError_enum::CUDA_SUCCESS {
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
        graph,
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
            NodeWork::Child(child, _) => unsafe {
                sys::cuGraphAddChildGraphNode(
                    &mut handle,
                    graph.0,
                    deps.as_ptr(),
                    deps.len(),
                    child.0,
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
        let _ = self.synchronize();
        self.exec_cache.clear();
        for e in self.free_events.drain(..) {
            // SAFETY: events are idle after the synchronise.
            unsafe { sys::cuEventDestroy_v2(e) };
        }
        // SAFETY: the streams are ours and idle.
        unsafe {
            sys::cuStreamDestroy_v2(self.stream);
            sys::cuStreamDestroy_v2(self.capture_stream);
        }
    }
}
