#include "bundle/pack.h"

#include "bundle/archive.h"
#include "bundle/verify.h"
#include "common/error.h"
#include "common/output.h"

namespace dp::bundle {

void pack_bundle(const Bundle& b, const std::filesystem::path& out_dpk, bool force) {
  if (b.is_archive()) fail(Errc::usage, "{}: is already a .dpk archive; pack takes a bundle directory", b.path().string());
  refuse_output_over_input(out_dpk, b.path(), "bundle directory");
  plan_output(out_dpk, OutputKind::file, force, "a bundle archive", bundle_own_files);
  // A directory that holds anything but its listed files, or a file that changed, is not packed: the
  // archive would carry it to every host that pulls it.
  const VerifyReport report = verify_bundle(b, {});
  if (!report.ok()) {
    std::string list;
    for (size_t i = 0; i < report.problems.size() && i < 5; ++i)
      list += fmt::format("\n  {} {}: {}", report.problems[i].what, report.problems[i].object, report.problems[i].message);
    if (report.problems.size() > 5) list += fmt::format("\n  ... and {} more", report.problems.size() - 5);
    fail(Errc::verify, "{}: not packed: the directory does not verify ({} problems):{}", b.path().string(),
         report.problems.size(), list);
  }
  write_archive(b.path(), out_dpk);
}

}  // namespace dp::bundle
