//! Several GPUs: NCCL communicators and collectives on kiln arrays.
//!
//! NCCL is found and loaded at run time, as NVRTC is (`KILN_NCCL_LIB`, then the dynamic
//! linker's path, then the `nvidia-nccl-cu13` / `-cu12` wheel of a Python environment); kiln
//! has no build-time dependency on it. A [`Communicator`] is one rank on one GPU, made for all
//! GPUs of one process at once ([`Communicator::init_all`], one thread per rank afterwards) or
//! for one process per GPU ([`Communicator::init_rank`] with a [`UniqueId`] handed over by the
//! launcher, or [`Communicator::from_env`]). Its collectives are encoded on a
//! [`CommandEncoder`](crate::runtime::CommandEncoder) of the same GPU, ordered with the
//! encoder's other work in direct and graph mode alike.
//!
//! Nothing here waits forever: a collective whose peers never come, or that NCCL reports
//! failed, ends the wait for it after `KILN_NCCL_TIMEOUT` seconds with an error, and the
//! communicator is aborted.

mod collective;
mod comm;
mod hash_words;
pub mod library;

pub(crate) use collective::COLLECTIVE_CHECK;
pub use collective::{specs, ReduceOp};
pub use comm::{Communicator, UniqueId};
pub use library::Nccl;
