//! Opaque handles for CUDA objects the shim mints (contexts, streams,
//! events, modules, functions, libraries, kernels).
//!
//! A handle is `tag << 48 | id`: never null, never one of the special stream
//! values (0x1, 0x2), never dereferenced, and its type is checked on every
//! use, so a stale or wrong-type handle is CUDA_ERROR_INVALID_HANDLE rather
//! than a crash. Ids are never reused within a process.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

pub struct Table<T> {
    tag: u64,
    next: AtomicU64,
    map: RwLock<HashMap<u64, Arc<T>>>,
}

impl<T> Table<T> {
    pub fn new(tag: u16) -> Self {
        Table { tag: (tag as u64) << 48, next: AtomicU64::new(1), map: RwLock::new(HashMap::new()) }
    }

    pub fn insert(&self, v: T) -> (u64, Arc<T>) {
        let h = self.tag | self.next.fetch_add(1, Ordering::Relaxed);
        let v = Arc::new(v);
        self.map.write().unwrap_or_else(|e| e.into_inner()).insert(h, v.clone());
        (h, v)
    }

    /// Inserts under a handle minted earlier by [`Table::mint`]
    /// (for objects the server must know by handle before they exist here).
    pub fn insert_with_handle(&self, h: u64, v: T) -> Arc<T> {
        let v = Arc::new(v);
        self.map.write().unwrap_or_else(|e| e.into_inner()).insert(h, v.clone());
        v
    }

    /// Inserts an object that is shared elsewhere too, under a handle minted earlier.
    pub fn insert_arc(&self, h: u64, v: Arc<T>) {
        self.map.write().unwrap_or_else(|e| e.into_inner()).insert(h, v);
    }

    /// A fresh handle of this table's type, not yet bound to an object.
    pub fn mint(&self) -> u64 {
        self.tag | self.next.fetch_add(1, Ordering::Relaxed)
    }

    pub fn get(&self, h: u64) -> Option<Arc<T>> {
        if h & !((1u64 << 48) - 1) != self.tag {
            return None;
        }
        self.map.read().unwrap_or_else(|e| e.into_inner()).get(&h).cloned()
    }

    pub fn remove(&self, h: u64) -> Option<Arc<T>> {
        self.map.write().unwrap_or_else(|e| e.into_inner()).remove(&h)
    }

    /// Handles whose object satisfies `pred`.
    pub fn select(&self, pred: impl Fn(&T) -> bool) -> Vec<u64> {
        let m = self.map.read().unwrap_or_else(|e| e.into_inner());
        m.iter().filter(|(_, v)| pred(v)).map(|(h, _)| *h).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rgpu_cuda_types::tag;

    #[test]
    fn handles_are_typed_and_not_reused() {
        let a: Table<u32> = Table::new(tag::STREAM);
        let b: Table<u32> = Table::new(tag::EVENT);
        let (h1, _) = a.insert(7);
        assert_eq!(*a.get(h1).unwrap(), 7);
        assert!(b.get(h1).is_none(), "a stream handle is not an event");
        assert!(a.get(0).is_none() && a.get(1).is_none() && a.get(2).is_none());
        a.remove(h1);
        assert!(a.get(h1).is_none());
        let (h2, _) = a.insert(8);
        assert_ne!(h1, h2);
    }
}
