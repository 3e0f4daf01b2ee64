//! The fuzz binaries' allocator: the system allocator with a ceiling on any one allocation, so
//! that a hostile input that makes hf2q ask for a huge buffer (a length field trusted before it
//! is checked against the file) is a finding (an abort AFL counts as a crash) rather than a
//! machine brought down by swapping or an out-of-memory kill that reads as a hang.
//!
//! The ceiling is [`DEFAULT_CAP`] unless a binary sets another with [`set_cap`] before the first
//! input. Inputs are at most a few megabytes and models tiny, so nothing legitimate comes near it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// 256 MiB: a hundred times the largest buffer the targets need on their largest inputs.
pub const DEFAULT_CAP: usize = 256 << 20;

static CAP: AtomicUsize = AtomicUsize::new(DEFAULT_CAP);

/// Sets the ceiling, in bytes, for one allocation.
pub fn set_cap(bytes: usize) {
    CAP.store(bytes, Ordering::Relaxed);
}

pub struct CappedAlloc;

impl CappedAlloc {
    #[inline]
    fn check(size: usize) {
        if size > CAP.load(Ordering::Relaxed) {
            // Lift the ceiling so that the report itself may allocate, then say where and abort.
            CAP.store(usize::MAX, Ordering::Relaxed);
            eprintln!(
                "hf2q-fuzz: one allocation of {size} bytes, over the ceiling (a length taken from \
                 the input before it was checked?), at:\n{}",
                std::backtrace::Backtrace::force_capture()
            );
            std::process::abort();
        }
    }
}

// SAFETY: delegates to the system allocator; the check only aborts.
unsafe impl GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Self::check(layout.size());
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        Self::check(layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        Self::check(new_size);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static GLOBAL: CappedAlloc = CappedAlloc;
