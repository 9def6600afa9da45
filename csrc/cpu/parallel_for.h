// Runs fn(task) for task in [0, num_tasks) on up to hardware_concurrency threads. Tasks are claimed from a
// shared counter, so uneven tasks (causal rows) balance themselves.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace jax_flash::cpu {

template <typename Fn>
void parallel_for(int64_t num_tasks, Fn&& fn) {
  const int64_t hardware = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t num_threads = std::min(hardware, num_tasks);
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t task = next.fetch_add(1); task < num_tasks; task = next.fetch_add(1)) fn(task);
  };
  std::vector<std::thread> threads;
  for (int64_t t = 1; t < num_threads; ++t) threads.emplace_back(worker);
  worker();
  for (auto& thread : threads) thread.join();
}

inline int64_t worker_count() { return std::max<int64_t>(1, std::thread::hardware_concurrency()); }

}  // namespace jax_flash::cpu
