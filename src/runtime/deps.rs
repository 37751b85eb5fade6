//! Graph-mode dependency tracking, as pure logic: which earlier nodes a new node must wait for,
//! and the topology key (node kinds plus edges, never pointers or arguments) of a graph.
//!
//! A node waits for the last writer of every buffer it reads or writes (read-after-write,
//! write-after-write), and a writer also waits for every reader since the last write
//! (write-after-read). Buffers are tracked whole: two views of one allocation conflict.

use std::collections::HashMap;
use std::fmt::Write;

/// Identifies one allocation (its base device address).
pub type BufferId = u64;

/// What a node is, for the topology key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeKind {
    Kernel,
    Empty,
    /// A stream-captured child graph.
    Child,
}

impl NodeKind {
    fn letter(self) -> char {
        match self {
            NodeKind::Kernel => 'K',
            NodeKind::Empty => 'E',
            NodeKind::Child => 'G',
        }
    }
}

#[derive(Default)]
struct ConcurrentSection {
    nodes: Vec<u32>,
    reads: Vec<BufferId>,
    writes: Vec<BufferId>,
}

/// Tracks buffer accesses of the nodes added since the last commit.
#[derive(Default)]
pub struct DependencyTracker {
    last_writer: HashMap<BufferId, u32>,
    readers: HashMap<BufferId, Vec<u32>>,
    concurrent: Option<ConcurrentSection>,
    node_count: u32,
    key: String,
}

impl DependencyTracker {
    pub fn new() -> DependencyTracker {
        DependencyTracker::default()
    }

    pub fn node_count(&self) -> u32 {
        self.node_count
    }

    /// The topology key of the nodes added so far.
    pub fn topology_key(&self) -> &str {
        &self.key
    }

    pub fn in_concurrent_section(&self) -> bool {
        self.concurrent.is_some()
    }

    /// Adds a node that reads `reads` and writes `writes`; returns its index and its
    /// dependencies (sorted, no duplicates). A buffer in both lists counts as written.
    pub fn add(
        &mut self,
        kind: NodeKind,
        reads: &[BufferId],
        writes: &[BufferId],
    ) -> (u32, Vec<u32>) {
        let node = self.node_count;
        self.node_count += 1;
        let mut deps: Vec<u32> = Vec::new();
        for b in reads.iter().chain(writes) {
            if let Some(&w) = self.last_writer.get(b) {
                deps.push(w);
            }
        }
        for b in writes {
            if let Some(rs) = self.readers.get(b) {
                deps.extend_from_slice(rs);
            }
        }
        deps.sort_unstable();
        deps.dedup();
        self.record_key(kind, node, &deps);
        match &mut self.concurrent {
            // Inside a section nodes see the state from before it; the join updates the state.
            Some(section) => {
                section.nodes.push(node);
                section.reads.extend_from_slice(reads);
                section.writes.extend_from_slice(writes);
            }
            None => self.record_access(node, reads, writes),
        }
        (node, deps)
    }

    fn record_access(&mut self, node: u32, reads: &[BufferId], writes: &[BufferId]) {
        for b in reads {
            if !writes.contains(b) {
                self.readers.entry(*b).or_default().push(node);
            }
        }
        for b in writes {
            self.last_writer.insert(*b, node);
            if let Some(rs) = self.readers.get_mut(b) {
                rs.clear();
            }
        }
    }

    fn record_key(&mut self, kind: NodeKind, node: u32, deps: &[u32]) {
        let _ = write!(self.key, "{}{node}", kind.letter());
        for (i, d) in deps.iter().enumerate() {
            let _ = write!(self.key, "{}{d}", if i == 0 { ':' } else { ',' });
        }
        self.key.push(';');
    }

    /// Starts a section whose nodes do not depend on each other.
    pub fn begin_concurrent(&mut self) {
        if self.concurrent.is_none() {
            self.concurrent = Some(ConcurrentSection::default());
        }
    }

    /// Ends the section with an empty join node that depends on all of its nodes and stands for
    /// them afterwards. Returns the join's index and dependencies (`None` for an empty section).
    pub fn end_concurrent(&mut self) -> Option<(u32, Vec<u32>)> {
        let section = self.concurrent.take()?;
        if section.nodes.is_empty() {
            return None;
        }
        let join = self.node_count;
        self.node_count += 1;
        let deps = section.nodes.clone();
        self.record_key(NodeKind::Empty, join, &deps);
        self.record_access(join, &section.reads, &section.writes);
        Some((join, deps))
    }

    /// Forgets everything (after a commit).
    pub fn clear(&mut self) {
        self.last_writer.clear();
        self.readers.clear();
        self.concurrent = None;
        self.node_count = 0;
        self.key.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use NodeKind::*;

    const A: BufferId = 0x1000;
    const B: BufferId = 0x2000;
    const C: BufferId = 0x3000;

    #[test]
    fn read_after_write() {
        let mut t = DependencyTracker::new();
        assert_eq!(t.add(Kernel, &[], &[A]), (0, vec![]));
        assert_eq!(t.add(Kernel, &[A], &[B]), (1, vec![0]));
        assert_eq!(t.add(Kernel, &[B], &[C]), (2, vec![1]));
        assert_eq!(t.topology_key(), "K0;K1:0;K2:1;");
    }

    #[test]
    fn write_after_read_waits_for_every_reader() {
        let mut t = DependencyTracker::new();
        t.add(Kernel, &[], &[A]); // 0 writes A
        t.add(Kernel, &[A], &[B]); // 1 reads A
        t.add(Kernel, &[A], &[C]); // 2 reads A
        assert_eq!(t.add(Kernel, &[], &[A]), (3, vec![0, 1, 2]));
        // After the write, the old readers are forgotten.
        assert_eq!(t.add(Kernel, &[], &[A]), (4, vec![3]));
    }

    #[test]
    fn write_after_write() {
        let mut t = DependencyTracker::new();
        t.add(Kernel, &[], &[A]);
        assert_eq!(t.add(Kernel, &[], &[A]), (1, vec![0]));
    }

    #[test]
    fn independent_nodes_have_no_edges() {
        let mut t = DependencyTracker::new();
        t.add(Kernel, &[A], &[B]);
        assert_eq!(t.add(Kernel, &[A], &[C]), (1, vec![]));
        assert_eq!(t.topology_key(), "K0;K1;");
    }

    #[test]
    fn aliasing_views_of_one_buffer_conflict() {
        // Two views of one allocation carry the same BufferId: a write through one orders after
        // a read through the other.
        let mut t = DependencyTracker::new();
        t.add(Kernel, &[A], &[B]);
        assert_eq!(t.add(Kernel, &[C], &[A]), (1, vec![0]));
    }

    #[test]
    fn in_place_update_depends_on_the_last_writer_only() {
        let mut t = DependencyTracker::new();
        t.add(Kernel, &[], &[A]);
        assert_eq!(t.add(Kernel, &[A], &[A]), (1, vec![0]));
        assert_eq!(t.add(Kernel, &[A], &[A]), (2, vec![1]));
    }

    #[test]
    fn concurrent_section_nodes_share_dependencies_and_join() {
        let mut t = DependencyTracker::new();
        t.add(Kernel, &[], &[A]); // 0
        t.begin_concurrent();
        assert_eq!(t.add(Kernel, &[A], &[B]), (1, vec![0]));
        // Would depend on 1 (WAW on B) outside a section; inside it does not.
        assert_eq!(t.add(Kernel, &[A], &[B]), (2, vec![0]));
        assert_eq!(t.add(Child, &[A], &[C]), (3, vec![0]));
        assert_eq!(t.end_concurrent(), Some((4, vec![1, 2, 3])));
        // Afterwards the join stands for the section: readers of B and C wait for it, and a
        // writer of A waits for it too (the section read A).
        assert_eq!(t.add(Kernel, &[B], &[]), (5, vec![4]));
        assert_eq!(t.add(Kernel, &[], &[A]), (6, vec![0, 4]));
        assert_eq!(t.topology_key(), "K0;K1:0;K2:0;G3:0;E4:1,2,3;K5:4;K6:0,4;");
    }

    #[test]
    fn an_empty_section_adds_no_node() {
        let mut t = DependencyTracker::new();
        t.begin_concurrent();
        assert_eq!(t.end_concurrent(), None);
        assert_eq!(t.node_count(), 0);
    }

    #[test]
    fn keys_ignore_addresses_but_not_structure() {
        let key = |bufs: [BufferId; 2], chain: bool| {
            let mut t = DependencyTracker::new();
            t.add(Kernel, &[], &[bufs[0]]);
            let reads: Vec<BufferId> = if chain { vec![bufs[0]] } else { vec![] };
            t.add(Kernel, &reads, &[bufs[1]]);
            t.topology_key().to_string()
        };
        assert_eq!(key([A, B], true), key([B, C], true));
        assert_ne!(key([A, B], true), key([A, B], false));
    }

    #[test]
    fn clear_starts_over() {
        let mut t = DependencyTracker::new();
        t.add(Kernel, &[], &[A]);
        t.clear();
        assert_eq!(t.add(Kernel, &[A], &[]), (0, vec![]));
        assert_eq!(t.topology_key(), "K0;");
    }
}
