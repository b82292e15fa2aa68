// MLX's CUDA wheels include <fmt/format.h> in headers the native reader includes
// (mlx/backend/cuda/lru_cache.h) but ship no fmt. dsv4 calls none of what uses it; this declares
// the name so those headers parse. Searched after the system's headers (-idirafter): a real fmt wins.
#pragma once
#include <string>
namespace fmt {
template <typename... Args>
std::string format(Args&&... args);
}
