//! The collectives on kiln arrays, encoded on a command encoder like any other op. Each is
//! captured into a graph the first time it is encoded, and the encoder keeps the capture by its
//! signature (communicator, call, buffers, count): in graph mode it becomes a child-graph node
//! that depends on the last writers of the arrays it reads and writes (and on the
//! communicator's previous collective, since NCCL runs one communicator's collectives in the
//! order they were issued); in direct mode its executable is launched on the stream. A
//! repeated collective so costs a graph node or a graph launch, not a call into NCCL: on a
//! non-blocking communicator each call starts a thread, tens of microseconds that made small
//! collectives host-bound.
//!
//! With `KILN_NCCL_CHECK` on (the default), each collective also sends a 32-bit hash of what
//! this rank called (op, reduction, dtype, element count, root) with its data, in the same NCCL
//! group, and a one-thread kernel compares the hashes that arrived with its own. A mismatch is
//! reported by the wait that sees the collective finish, as [`Error::CollectiveMismatch`]; a
//! mismatch that makes NCCL hang ends in [`Error::CollectiveTimeout`] instead.

use std::ffi::c_void;
use std::ptr;

use cudarc::driver::sys;
use cudarc::nccl::sys::{ncclDataType_t, ncclRedOp_t};

use super::comm::check_driver;
use super::comm::{Communicator, Shared};
use super::library::{Nccl, IN_PROGRESS};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::jit::{KernelSpec, TemplateDef};
use crate::runtime::{Array, CommandEncoder, KernelArgs};

/// How values from the ranks are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// The sum over the ranks.
    Sum,
    /// The product over the ranks.
    Prod,
    /// The largest value.
    Max,
    /// The smallest value.
    Min,
    /// The sum divided by the number of ranks.
    Avg,
}

impl ReduceOp {
    /// Every reduction, in declaration order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
    ];

    fn nccl(self) -> i32 {
        (match self {
            ReduceOp::Sum => ncclRedOp_t::ncclSum,
            ReduceOp::Prod => ncclRedOp_t::ncclProd,
            ReduceOp::Max => ncclRedOp_t::ncclMax,
            ReduceOp::Min => ncclRedOp_t::ncclMin,
            ReduceOp::Avg => ncclRedOp_t::ncclAvg,
        }) as i32
    }

    /// Its lowercase name (`sum`, `avg`, ...), as error messages describe a collective.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Avg => "avg",
        }
    }
}

fn nccl_dtype(dtype: DType) -> i32 {
    (match dtype {
        DType::F32 => ncclDataType_t::ncclFloat32,
        DType::F16 => ncclDataType_t::ncclFloat16,
        DType::BF16 => ncclDataType_t::ncclBfloat16,
    }) as i32
}

pub static COLLECTIVE_CHECK: TemplateDef = TemplateDef {
    name: "collective_check",
    source: include_str!("../../templates/collective_check.cu"),
    kernel: "kiln_collective_check",
    const_names: &[],
    arch_specific: false,
    only_arch: None,
};

/// The check kernel's one spec (it reads 32-bit words whatever the data's dtype).
pub fn check_spec() -> KernelSpec {
    KernelSpec::new(&COLLECTIVE_CHECK, DType::F32, 32, 1, &[])
}

/// Every spec the collectives can launch (the check kernel's), for `kiln warm`.
pub fn specs() -> Vec<KernelSpec> {
    vec![check_spec()]
}

/// The arguments every collective with a send and a receive buffer passes to NCCL.
struct PairArgs {
    send: *const c_void,
    recv: *mut c_void,
    dtype: i32,
    comm: cudarc::nccl::sys::ncclComm_t,
    stream: sys::CUstream,
}

/// Where the collective check's hashes live: this rank's (sent) and those the ranks sent it.
#[derive(Clone, Copy)]
struct CheckWords {
    own: u64,
    received: u64,
}

/// What one rank's call is, as every rank involved must agree on it.
#[derive(Clone, Copy, Debug)]
enum Call {
    AllReduce(ReduceOp),
    AllGather,
    ReduceScatter(ReduceOp),
    Broadcast {
        root: usize,
    },
    /// A send and the matching receive hash alike: both name the pair's element count.
    PointToPoint,
}

impl Call {
    fn code(self) -> u32 {
        match self {
            Call::AllReduce(op) => 0x100 | op.nccl() as u32,
            Call::AllGather => 0x200,
            Call::ReduceScatter(op) => 0x300 | op.nccl() as u32,
            Call::Broadcast { root } => 0x400 | ((root as u32) << 12),
            Call::PointToPoint => 0x500,
        }
    }

    /// FNV-1a over (call, dtype, count); never zero (zero marks "nothing received").
    fn hash(self, dtype: DType, count: usize) -> u32 {
        let mut h: u32 = 0x811c_9dc5;
        let words = [self.code() as u64, dtype.code() as u64, count as u64];
        for w in words {
            for byte in w.to_le_bytes() {
                h ^= byte as u32;
                h = h.wrapping_mul(0x0100_0193);
            }
        }
        h.max(1)
    }

    fn describe(self, dtype: DType, count: usize) -> String {
        match self {
            Call::AllReduce(op) => format!("all_reduce({}) of {count} {dtype}", op.name()),
            Call::AllGather => format!("all_gather of {count} {dtype} per rank"),
            Call::ReduceScatter(op) => {
                format!("reduce_scatter({}) to {count} {dtype} per rank", op.name())
            }
            Call::Broadcast { root } => format!("broadcast from rank {root} of {count} {dtype}"),
            Call::PointToPoint => format!("send/recv of {count} {dtype}"),
        }
    }
}

fn invalid(arg: &'static str, reason: String) -> Error {
    Error::InvalidArgument { arg, reason }
}

impl Communicator {
    fn check_array(&self, enc: &CommandEncoder, name: &'static str, a: &Array) -> Result<()> {
        let ordinal = self.shared.device.ordinal();
        for (arg, got) in [
            ("enc", enc.device().ordinal()),
            (name, a.device().ordinal()),
        ] {
            if got != ordinal {
                return Err(Error::DeviceMismatch {
                    arg,
                    expected: ordinal,
                    got,
                });
            }
        }
        if !a.is_contiguous() {
            return Err(invalid(
                name,
                "must be contiguous (copy a strided view with `contiguous` first)".into(),
            ));
        }
        Ok(())
    }

    fn check_pair(
        &self,
        enc: &CommandEncoder,
        input: &Array,
        output: &Array,
        output_elems: usize,
    ) -> Result<()> {
        self.check_array(enc, "input", input)?;
        self.check_array(enc, "output", output)?;
        if input.dtype() != output.dtype() {
            return Err(invalid(
                "output",
                format!("is {}, the input {}", output.dtype(), input.dtype()),
            ));
        }
        if output.size() != output_elems {
            return Err(invalid(
                "output",
                format!(
                    "has {} elements; this collective over {} ranks with an input of {} needs {}",
                    output.size(),
                    self.nranks(),
                    input.size(),
                    output_elems
                ),
            ));
        }
        Ok(())
    }

    fn check_rank(&self, arg: &'static str, r: usize) -> Result<()> {
        if r >= self.nranks() {
            return Err(invalid(
                arg,
                format!("rank {r}, but the communicator has {} ranks", self.nranks()),
            ));
        }
        Ok(())
    }

    /// `output` = the reduction over ranks of `input` (same dtype and size; `output` may be
    /// `input`).
    pub fn all_reduce(
        &self,
        enc: &mut CommandEncoder,
        input: &Array,
        output: &Array,
        op: ReduceOp,
    ) -> Result<()> {
        self.check_pair(enc, input, output, input.size())?;
        let count = input.size();
        self.encode_pair(
            enc,
            Call::AllReduce(op),
            input,
            output,
            count,
            |n, a| unsafe {
                (n.all_reduce)(a.send, a.recv, count, a.dtype, op.nccl(), a.comm, a.stream)
            },
        )
    }

    /// `output` = every rank's `input`, in rank order (`output` has nranks x its elements).
    pub fn all_gather(
        &self,
        enc: &mut CommandEncoder,
        input: &Array,
        output: &Array,
    ) -> Result<()> {
        self.check_pair(enc, input, output, input.size() * self.nranks())?;
        let count = input.size();
        self.encode_pair(enc, Call::AllGather, input, output, count, |n, a| unsafe {
            (n.all_gather)(a.send, a.recv, count, a.dtype, a.comm, a.stream)
        })
    }

    /// `output` = this rank's slice (rank r gets elements r*k..(r+1)*k, k = output's size) of the
    /// reduction over ranks of `input` (nranks x k elements).
    pub fn reduce_scatter(
        &self,
        enc: &mut CommandEncoder,
        input: &Array,
        output: &Array,
        op: ReduceOp,
    ) -> Result<()> {
        let n = self.nranks();
        if input.size() % n != 0 {
            return Err(invalid(
                "input",
                format!("{} elements do not split over {n} ranks", input.size()),
            ));
        }
        self.check_pair(enc, input, output, input.size() / n)?;
        let count = output.size();
        self.encode_pair(
            enc,
            Call::ReduceScatter(op),
            input,
            output,
            count,
            |n, a| unsafe {
                (n.reduce_scatter)(a.send, a.recv, count, a.dtype, op.nccl(), a.comm, a.stream)
            },
        )
    }

    /// `output` = rank `root`'s `input` on every rank (`input` is read on the root only; it
    /// may be `output`).
    pub fn broadcast(
        &self,
        enc: &mut CommandEncoder,
        input: &Array,
        output: &Array,
        root: usize,
    ) -> Result<()> {
        self.check_rank("root", root)?;
        self.check_pair(enc, input, output, input.size())?;
        let count = input.size();
        self.encode_pair(
            enc,
            Call::Broadcast { root },
            input,
            output,
            count,
            |n, a| unsafe {
                (n.broadcast)(
                    a.send,
                    a.recv,
                    count,
                    a.dtype,
                    root as i32,
                    a.comm,
                    a.stream,
                )
            },
        )
    }

    /// Encodes a collective that reads `input` and writes `output`; `issue` makes the NCCL
    /// call with the arguments every such call shares. (The callers' `unsafe`: the buffers are
    /// the checked arrays' device addresses, `count` elements long, live until the commit that
    /// holds the call has finished; NCCL copies the other arguments.)
    fn encode_pair(
        &self,
        enc: &mut CommandEncoder,
        call: Call,
        input: &Array,
        output: &Array,
        count: usize,
        issue: impl FnOnce(&Nccl, PairArgs) -> i32,
    ) -> Result<()> {
        let (send, recv) = (input.device_ptr(), output.device_ptr());
        let dtype = nccl_dtype(input.dtype());
        let nccl = self.shared.nccl;
        self.encode(
            enc,
            call,
            input.dtype(),
            count,
            &[input],
            &[output],
            [send, recv],
            |comm, stream| {
                let args = PairArgs {
                    send: send as *const c_void,
                    recv: recv as *mut c_void,
                    dtype,
                    comm,
                    stream,
                };
                issue(nccl, args)
            },
        )
    }

    /// Sends `input` to rank `peer`, which receives it with [`Communicator::recv`].
    pub fn send(&self, enc: &mut CommandEncoder, input: &Array, peer: usize) -> Result<()> {
        self.check_peer(peer)?;
        self.check_array(enc, "input", input)?;
        let (count, dt) = (input.size(), nccl_dtype(input.dtype()));
        let buf = input.device_ptr();
        let nccl = self.shared.nccl;
        self.encode_p2p(enc, true, peer, input, |comm, stream| unsafe {
            (nccl.send)(buf as *const c_void, count, dt, peer as i32, comm, stream)
        })
    }

    /// Receives into `output` what rank `peer` sends with [`Communicator::send`] (same dtype
    /// and size).
    pub fn recv(&self, enc: &mut CommandEncoder, output: &Array, peer: usize) -> Result<()> {
        self.check_peer(peer)?;
        self.check_array(enc, "output", output)?;
        let (count, dt) = (output.size(), nccl_dtype(output.dtype()));
        let buf = output.device_ptr();
        let nccl = self.shared.nccl;
        self.encode_p2p(enc, false, peer, output, |comm, stream| unsafe {
            (nccl.recv)(buf as *mut c_void, count, dt, peer as i32, comm, stream)
        })
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        self.check_rank("peer", peer)?;
        if peer == self.rank() {
            return Err(invalid(
                "peer",
                format!("rank {peer} is this rank: send and receive need another rank"),
            ));
        }
        Ok(())
    }

    /// Encodes one collective: with the check on, in one NCCL group with the exchange of the
    /// ranks' hashes, followed by the check kernel.
    #[allow(clippy::too_many_arguments)]
    fn encode(
        &self,
        enc: &mut CommandEncoder,
        call: Call,
        dtype: DType,
        count: usize,
        reads: &[&Array],
        writes: &[&Array],
        buffers: [u64; 2],
        issue: impl FnOnce(cudarc::nccl::sys::ncclComm_t, sys::CUstream) -> i32,
    ) -> Result<()> {
        let hash = call.hash(dtype, count);
        let shared = &self.shared;
        if self.check_kernel.is_some() {
            shared.describe(hash, || call.describe(dtype, count));
        }
        let signature = [
            (shared.id << 32) | hash as u64,
            buffers[0],
            buffers[1],
            count as u64,
        ];
        let mut all_writes: Vec<&Array> = writes.to_vec();
        all_writes.push(&self.order);
        let nccl = shared.nccl;
        let nranks = shared.nranks;
        let words = self.check_words(hash)?;
        enc.add_watched(reads, &all_writes, signature, &self.watch, |stream| {
            self.issue_checked(stream, hash, words, 0, nranks, |comm, stream| {
                if let Some(words) = words {
                    // SAFETY: `own` holds this rank's hash; `received` has a word per rank.
                    let status = unsafe {
                        (nccl.all_gather)(
                            words.own as *const c_void,
                            words.received as *mut c_void,
                            1,
                            ncclDataType_t::ncclUint32 as i32,
                            comm,
                            stream,
                        )
                    };
                    nccl.check("ncclAllGather", status, Some(comm))?;
                }
                let status = issue(comm, stream);
                nccl.check("collective", status, Some(comm))
            })
        })
    }

    /// Encodes a send (`sending`) or a receive; with the check on, the sender's hash travels to
    /// the receiver in the same group.
    fn encode_p2p(
        &self,
        enc: &mut CommandEncoder,
        sending: bool,
        peer: usize,
        data: &Array,
        issue: impl FnOnce(cudarc::nccl::sys::ncclComm_t, sys::CUstream) -> i32,
    ) -> Result<()> {
        let (dtype, count) = (data.dtype(), data.size());
        let hash = Call::PointToPoint.hash(dtype, count);
        let shared = &self.shared;
        if self.check_kernel.is_some() {
            let verb = if sending { "send to" } else { "recv from" };
            shared.describe(hash, || format!("{verb} rank {peer} of {count} {dtype}"));
        }
        let signature = [
            (shared.id << 32) | hash as u64 | ((sending as u64) << 31),
            data.device_ptr(),
            peer as u64,
            count as u64,
        ];
        let (reads, mut writes): (Vec<&Array>, Vec<&Array>) = if sending {
            (vec![data], vec![])
        } else {
            (vec![], vec![data])
        };
        writes.push(&self.order);
        let nccl = shared.nccl;
        // A receiver checks the one hash that came from its peer (in word 4).
        let (first_rank, compared) = if sending { (peer, 0) } else { (peer, 1) };
        let words = self.check_words(hash)?;
        enc.add_watched(&reads, &writes, signature, &self.watch, |stream| {
            self.issue_checked(stream, hash, words, first_rank, compared, |comm, stream| {
                if let Some(words) = words {
                    let u32_type = ncclDataType_t::ncclUint32 as i32;
                    // SAFETY: `own` holds this rank's hash; `received` takes the peer's.
                    let status = unsafe {
                        if sending {
                            (nccl.send)(
                                words.own as *const c_void,
                                1,
                                u32_type,
                                peer as i32,
                                comm,
                                stream,
                            )
                        } else {
                            (nccl.recv)(
                                words.received as *mut c_void,
                                1,
                                u32_type,
                                peer as i32,
                                comm,
                                stream,
                            )
                        }
                    };
                    nccl.check(
                        if sending { "ncclSend" } else { "ncclRecv" },
                        status,
                        Some(comm),
                    )?;
                }
                let status = issue(comm, stream);
                nccl.check(
                    if sending { "ncclSend" } else { "ncclRecv" },
                    status,
                    Some(comm),
                )
            })
        })
    }

    /// The check's words for a collective with `hash` (None with the check off). Called
    /// before capture: the word holding the hash may have to be written first.
    fn check_words(&self, hash: u32) -> Result<Option<CheckWords>> {
        Ok(self.shared.hash_word(hash)?.map(|own| CheckWords {
            own,
            received: self.order.device_ptr() + 16,
        }))
    }

    /// On `stream`: `calls` (the hash exchange and the data) in one NCCL group, waited for
    /// until NCCL has issued them, then the check kernel over `compared` received hashes, the
    /// first from rank `first_rank`. Without the check, just `calls`.
    fn issue_checked(
        &self,
        stream: sys::CUstream,
        hash: u32,
        words: Option<CheckWords>,
        first_rank: usize,
        compared: usize,
        calls: impl FnOnce(cudarc::nccl::sys::ncclComm_t, sys::CUstream) -> Result<()>,
    ) -> Result<()> {
        let shared: &Shared = &self.shared;
        let nccl = shared.nccl;
        tracing::debug!("rank {}: issuing {hash:08x}", shared.rank);
        shared.with_comm(|comm| {
            // SAFETY: group calls have no preconditions; the end is always called.
            nccl.check("ncclGroupStart", unsafe { (nccl.group_start)() }, None)?;
            let issued = calls(comm, stream);
            // SAFETY: ends the group started above.
            let ended = unsafe { (nccl.group_end)() };
            issued?;
            if ended != IN_PROGRESS {
                nccl.check("ncclGroupEnd", ended, Some(comm))?;
            }
            Ok(())
        })?;
        // A non-blocking communicator may still be issuing (connecting to peers the first
        // time): the work must be on the stream before the capture ends or the next call.
        shared.wait_ready("issuing a collective")?;
        tracing::debug!("rank {}: issued {hash:08x}", shared.rank);
        if let (Some(words), Some(kernel), Some(status), true) = (
            words,
            self.check_kernel.as_ref(),
            shared.status_device_ptr(),
            compared > 0,
        ) {
            let mut args = KernelArgs::new();
            args.push(words.received)
                .push(compared as i32)
                .push(first_rank as i32)
                .push(hash)
                .push(status);
            let mut pointers = args.pointers();
            // SAFETY: the kernel belongs to this device's context and takes exactly these
            // arguments; the pointers are valid for the call (the driver copies the values).
            check_driver(unsafe {
                sys::cuLaunchKernel(
                    kernel.function.cu_function(),
                    1,
                    1,
                    1,
                    32,
                    1,
                    1,
                    0,
                    stream,
                    pointers.as_mut_ptr(),
                    ptr::null_mut(),
                )
            })?;
        }
        Ok(())
    }
}
