// Writing outputs without losing what was there before.
//
// 1. Staging entries name their owner. Every temporary file or directory that a command creates beside
//    an output while it works is called
//        .<output name>.<kind>-<pid>-<boot>-<random>@<host>
//    (kind: "staging" for a directory being filled, "tmp" for a file being written, "old" for a
//    previous output moved aside; boot: the first 8 hex digits of the kernel's boot id). A command
//    killed with SIGKILL cannot remove its own; the next command writing the same output removes those
//    whose owner is gone (remove_stale_staging()), and never one of a live process.
//
// 2. An output path is checked before anything is written over it (plan_output()). The command says
//    how it recognises its own previous output (a bundle's manifest.json, the marker file `synth`
//    writes); an output path that holds anything else is refused with Errc::usage, naming the path and
//    what is there, unless the user passes --force. Even then nothing but the tool's own files is
//    removed: a file named as the output is replaced, but a directory is written into, its other
//    entries kept.
//
// Example:
//   for (auto& p : dp::remove_stale_staging(out)) log("removed " + p.string());
//   dp::OutputPlan plan = dp::plan_output(out, dp::OutputKind::directory, force, "a bundle", bundle_files);
//   dp::StagingDir stage(out);  ... write into stage.path() ...
//   plan.action == dp::OutputPlan::Action::write_into ? stage.commit_into(plan.previous, {"manifest.json"})
//                                                     : stage.commit();
#pragma once

#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dp {

// A fresh name for a staging entry of `target` (in target's directory), recording this process.
std::filesystem::path staging_path(const std::filesystem::path& target, std::string_view kind);

// Who made a staging entry, parsed back from its name; nullopt for any other name.
struct StagingOwner {
  std::string kind;  // "staging", "tmp", "old"
  long pid = 0;
  std::string boot;  // 8 hex digits
  std::string host;
};
std::optional<StagingOwner> staging_owner(std::string_view entry_name, std::string_view target_name);

// True when the owner certainly no longer runs: same host, and another boot or no such pid. A process
// of another host, or a pid that is in use (perhaps reused by another program), counts as alive.
bool staging_owner_is_gone(const StagingOwner& owner);

// Removes the staging entries of `target` whose owner is gone, and returns them. A stale "old" entry
// (a previous output moved aside by a publication that was killed before it finished) is renamed back
// to `target` when nothing is there, instead of being removed. Errors are ignored: leftovers are
// litter, not a reason to fail a command.
std::vector<std::filesystem::path> remove_stale_staging(const std::filesystem::path& target);

enum class OutputKind { file, directory };

// How a command recognises an output that it wrote itself: the files of that output (relative
// paths, '/'-separated, the recognising file included), or nullopt when `path` is not one. For a file
// output, any value means "ours". Must not throw.
using OwnedFiles = std::function<std::optional<std::vector<std::string>>(const std::filesystem::path& path)>;

struct OutputPlan {
  enum class Action {
    create,      // nothing there, or an empty directory: publish with one rename
    replace,     // a previous output of the command (or, with --force, a file): swapped in one rename
    write_into,  // --force over a directory that holds other files: they are kept
  } action = Action::create;
  std::vector<std::string> previous;  // write_into: the previous output's own files, if recognised
  std::vector<std::string> others;    // write_into: the first few entries that are not ("data/" for a directory)
};

// Decides how `out` may be published, or throws Errc::usage naming the path, what is there and that
// --force would write over it. `what` names the output in messages ("a bundle", "a checkpoint").
// A directory where a file output goes is refused even with `force` (a directory is never removed).
OutputPlan plan_output(const std::filesystem::path& out, OutputKind kind, bool force, std::string_view what,
                       const OwnedFiles& owned);

// Refuses (Errc::usage) an output that is `input`, lies inside it, or contains it: publishing it
// would replace or remove the input. `input_what` names it in the message ("input checkpoint").
// Paths are compared after resolving symbolic links; an input that does not exist is not checked.
void refuse_output_over_input(const std::filesystem::path& out, const std::filesystem::path& input,
                              std::string_view input_what, std::string_view out_what = "output");

// Whether `a` and `b` are the same path or one lies inside the other, after resolving symbolic links
// (paths that do not exist yet are compared as written, made absolute).
bool paths_overlap(const std::filesystem::path& a, const std::filesystem::path& b);

// A relative path that cannot leave the directory it is joined to: not empty, not absolute, no empty,
// "." or ".." component.
bool is_safe_relative_path(std::string_view rel);

}  // namespace dp
