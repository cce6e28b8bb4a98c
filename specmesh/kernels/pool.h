// A small thread pool for specmesh's CPU kernels (small_gemm.cpp, q4_gemm.cpp) instead of
// at::parallel_for: an OpenMP region ends in a barrier that waits for every team thread, also one not
// scheduled yet, which on a shared 2-core machine costs a scheduler time slice (ms) for a product
// that takes 0.1-3 ms. Here the caller claims chunks itself and waits only for chunks another
// thread claimed. Each library that includes it has its own pool.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <pthread.h>
#include <thread>
#include <vector>

namespace specmesh_pool {

// A job: chunks [0, chunks) of a product in `ranges` contiguous runs, one a thread: each thread
// walks its own run in order (a stream the hardware prefetcher follows), then takes what is left of
// the others' (a thread descheduled on a shared machine holds no work back). `active` counts the
// workers inside.
struct Job {
  static constexpr int MAX_RANGES = 64;
  struct alignas(64) Run {
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
  std::atomic<int> joined{0};
  std::atomic<int> active{0};
  int ranges = 1;
  void (*run)(const void*, int64_t) = nullptr;
  const void* ctx = nullptr;
  Run runs[MAX_RANGES];

  void split(int64_t chunks, int threads) {
    ranges = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({threads, chunks, MAX_RANGES})));
    for (int r = 0; r < ranges; ++r) {
      runs[r].next.store(chunks * r / ranges, std::memory_order_relaxed);
      runs[r].end = chunks * (r + 1) / ranges;
    }
  }
  void work() {
    const int first = joined.fetch_add(1, std::memory_order_relaxed) % ranges;
    for (int k = 0; k < ranges; ++k) {
      Run& r = runs[(first + k) % ranges];
      for (int64_t c; (c = r.next.fetch_add(1, std::memory_order_relaxed)) < r.end;) run(ctx, c);
    }
  }
};

inline void relax() {  // a few pauses, then give the core to whoever else is runnable on it
  for (int i = 0; i < 16; ++i) _mm_pause();
  std::this_thread::yield();
}

class Pool {
 public:
  static constexpr int SPIN_US = 100;  // a worker spins this long for the next job before it sleeps

  void run(Job& job, int threads) {
    ensure(threads - 1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = &job;
      ++gen_;
    }
    cv_.notify_all();
    job.work();
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = nullptr;  // from now on no worker joins this job
    }
    // Workers mid-chunk. Yield, not just spin: on a busy machine one may share this core with us.
    while (job.active.load(std::memory_order_acquire) != 0) relax();
  }

 private:
  void ensure(int workers) {
    while (static_cast<int>(threads_.size()) < workers) {
      threads_.emplace_back([this] { loop(); });
      threads_.back().detach();  // lives as long as the process, like torch's own pools
    }
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(SPIN_US);
      while (gen_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until) relax();
      Job* job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return gen_.load(std::memory_order_relaxed) != seen; });
        seen = gen_.load(std::memory_order_relaxed);
        job = job_;
        if (job == nullptr) continue;  // that job is finished already
        job->active.fetch_add(1, std::memory_order_acq_rel);
      }
      job->work();
      job->active.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> gen_{0};
  Job* job_ = nullptr;
  std::vector<std::thread> threads_;
};

inline Pool* g_pool = nullptr;       // never destroyed: detached workers may still read it at exit
inline std::mutex* g_caller = nullptr;  // one product at a time uses the pool; others run on their own thread

inline void fresh_pool() {  // also in a forked child, which has none of the parent's workers (and maybe a held lock)
  g_pool = new Pool();
  g_caller = new std::mutex();
}

inline Pool& pool() {
  static const bool once = [] {
    fresh_pool();
    pthread_atfork(nullptr, nullptr, fresh_pool);
    return true;
  }();
  (void)once;
  return *g_pool;
}


// Runs run(ctx, c) for c in [0, chunks) on up to `threads` threads (the caller's share of the
// process's budget: `specmesh.kernels.pool_threads()`, passed by each op's caller).
inline void parallel_chunks(int64_t chunks, void (*run)(const void*, int64_t), const void* ctx, int64_t threads) {
  Job job;
  job.run = run;
  job.ctx = ctx;
  Pool& workers = pool();
  std::unique_lock<std::mutex> lock(*g_caller, std::try_to_lock);
  if (threads <= 1 || chunks <= 1 || !lock.owns_lock() || at::in_parallel_region()) {
    job.split(chunks, 1);
    job.work();
  } else {
    const int team = static_cast<int>(std::min<int64_t>(threads, 256));
    job.split(chunks, team);
    workers.run(job, team);
  }
}

}  // namespace specmesh_pool
