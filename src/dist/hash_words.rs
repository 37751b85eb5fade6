//! The device words the collective check sends this rank's hashes from: one word per distinct
//! hash, written once, when the hash is first used. A collective then needs no write of its own
//! before its hash exchange (in graph mode that was a memset node in front of every collective,
//! about a microsecond of each small one).

use std::collections::HashMap;
use std::ptr;
use std::sync::Arc;

use cudarc::driver::sys;

use super::comm::check_driver;
use crate::error::Result;
use crate::runtime::Device;

/// Words per allocation. A program uses a handful of distinct (collective, dtype, count)
/// triples; one with ever-changing counts adds 4 bytes per new count.
const CHUNK_WORDS: usize = 256;

pub(crate) struct HashWords {
    device: Arc<Device>,
    /// A stream of its own for the one write per word, waited for at once: no other work
    /// (a collective waiting for a peer) stands in front of it.
    stream: sys::CUstream,
    chunks: Vec<sys::CUdeviceptr>,
    /// Words taken in the newest chunk.
    used: usize,
    words: HashMap<u32, sys::CUdeviceptr>,
    /// Set after an abort: queued work may still read the words, so they are never freed.
    leak: bool,
}

// SAFETY: the stream and the allocations are plain driver handles, usable from any thread with
// the device's context bound; the owner serialises access (a mutex).
unsafe impl Send for HashWords {}

impl HashWords {
    pub(crate) fn new(device: &Arc<Device>) -> Result<HashWords> {
        device.bind()?;
        let mut stream = ptr::null_mut();
        // SAFETY: the device's context is current.
        check_driver(unsafe {
            sys::cuStreamCreate(
                &mut stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
        })?;
        Ok(HashWords {
            device: device.clone(),
            stream,
            chunks: Vec::new(),
            used: 0,
            words: HashMap::new(),
            leak: false,
        })
    }

    /// The device address of a word holding `hash`, written and complete before this returns.
    /// Call it outside stream capture (it may allocate).
    pub(crate) fn word(&mut self, hash: u32) -> Result<sys::CUdeviceptr> {
        if let Some(&word) = self.words.get(&hash) {
            return Ok(word);
        }
        self.device.bind()?;
        if self.chunks.is_empty() || self.used == CHUNK_WORDS {
            let mut chunk = 0;
            // SAFETY: allocates device memory on the bound context.
            check_driver(unsafe { sys::cuMemAlloc_v2(&mut chunk, CHUNK_WORDS * 4) })?;
            self.chunks.push(chunk);
            self.used = 0;
        }
        let word = self.chunks[self.chunks.len() - 1] + 4 * self.used as u64;
        // SAFETY: the word lies inside the newest chunk; the stream is ours.
        check_driver(unsafe { sys::cuMemsetD32Async(word, hash, 1, self.stream) })?;
        // SAFETY: as above.
        check_driver(unsafe { sys::cuStreamSynchronize(self.stream) })?;
        self.used += 1;
        self.words.insert(hash, word);
        Ok(word)
    }

    /// Keeps the words allocated for good (see `leak`).
    pub(crate) fn leak(&mut self) {
        self.leak = true;
    }
}

impl Drop for HashWords {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: the stream is idle (each write was waited for) and destroyed once; the chunks
        // were allocated here, and without an abort no work that reads them is left (every
        // graph holding a collective of this communicator holds the communicator).
        unsafe {
            sys::cuStreamDestroy_v2(self.stream);
            if !self.leak {
                for &chunk in &self.chunks {
                    sys::cuMemFree_v2(chunk);
                }
            }
        }
    }
}
