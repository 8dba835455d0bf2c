// Memory for packed weights and the engine's buffers (memory.cc): aligned mappings of their own, 2 MiB
// pages, prefaulting, the C heap's freed memory handed back.
#pragma once
#include <cstddef>
#include <functional>
#include <memory>

namespace corelm {

// Zeroed, 64-byte aligned memory. Large buffers are fresh mappings, zero without being touched, so a
// packer that writes them in parallel also faults their pages in in parallel (no memset first). With
// huge_pages they are asked for 2 MiB pages: right for data streamed end to end (weights), wrong for
// data filled a little at a time in many places (the KV cache), where each first write would make
// 2 MiB resident.
std::shared_ptr<void> aligned_buffer(size_t bytes, bool huge_pages = true);
// Whether large buffers still ask for 2 MiB pages: CORELM_HUGE_PAGES=auto (default) until one 2 MiB page
// takes longer than 1 ms to fault in (memory.cc: VMs whose fresh memory is slow), 1 always, 0 never.
bool huge_pages_in_use();
// Whether auto stopped asking because a 2 MiB page came slowly: buffers since are on 4 KiB pages.
bool huge_pages_came_slow();
// Moves the whole 2 MiB pages inside [p, p + bytes), resident on 4 KiB pages, onto 2 MiB pages, one at a
// time (MADV_COLLAPSE, Linux 6.1+; the data stays where it is, readers may go on reading), asking go_on()
// before each (false: stop); returns the bytes moved, *unsupported where the kernel can't (then stops).
// Slow where fresh 2 MiB pages are (~15 ms each, part of it holding the process's page tables): for a
// thread of idle priority that waits while the model computes.
size_t collapse_into_huge_pages(void* p, size_t bytes, const std::function<bool()>& go_on, bool* unsupported);
// Makes the pages of [p, p + bytes) resident and writable before a packer fills them: one call faults the
// range in, where its writes would take a trap per page; and a packer that reads a fresh page before
// writing it (OR-ing bits in) would first map the shared zero page, which the write then replaces with a
// TLB flush on every CPU the process runs on (in a VM, a VM exit each; 2.5x slower loads at 2 threads).
// A hint: no-op where unsupported.
void prefault_for_write(void* p, size_t bytes);
// Hands the C heap's freed memory back to the OS (glibc keeps freed chunks under its mmap threshold, which
// grows after large frees: the loader's transient copies); a no-op elsewhere.
void release_freed_heap();
// Whether aligned_buffer(bytes) gets a mapping of its own (no page shared with other data), so its
// pages may be moved between NUMA nodes; smaller buffers can start on a page boundary by chance.
bool aligned_buffer_owns_pages(size_t bytes);

}  // namespace corelm
