// The playground page's files (server/playground/), compiled into the daemon by embed.cmake so
// that the page needs nothing but the daemon: no files to install, no CDN.
#pragma once

#include <cstddef>
#include <string_view>

namespace imagegen::server {

struct StaticAsset {
  const char* path;  // the URL path it is served at
  const char* type;  // its Content-Type
  const unsigned char* data;
  size_t size;
};

// The asset served at `path`, or nullptr.
const StaticAsset* FindPlaygroundAsset(std::string_view path);

}  // namespace imagegen::server
