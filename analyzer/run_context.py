"""What the run directories beside a diff's two traces add to it: the baseline's manifest (the environment and the
capture commands of the head), each arm's prefill query dtype from the log of the run that exported its trace (the
query-quantization statement), and the headline made with them.

A Python caller gets the headline `kvtrace diff` shows:

    context = RunContext.of(baseline, candidate)
    result = context.attach(compare.diff(open_trace(baseline), open_trace(candidate), load_recipes()))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvtrace.analyzer import headline, statements
from kvtrace.analyzer.results import Diff
from kvtrace.analyzer.runs import trace_query_dtypes
from kvtrace.manifest import Manifest


@dataclass(frozen=True)
class RunContext:
    manifest: Manifest | None  # of the baseline's run directory, if the trace sits in one
    query_dtypes: tuple[str | None, str | None]  # each arm's prefill query dtype, where its run's log says it
    read: tuple[Path, ...]  # the manifests and logs read besides the traces: inputs no output may replace

    @classmethod
    def of(cls, baseline: Path, candidate: Path | None = None) -> RunContext:
        """The context of two traces; `candidate` None: one trace holds both arms (--arms), whose one log tells
        neither arm's query dtype apart."""
        manifest = headline.find_manifest(baseline)
        read = [manifest.path] if manifest is not None else []
        if candidate is None:
            return cls(manifest, (None, None), tuple(read))
        found = []
        # Both arms of one run directory share its manifest: read it once, list it once.
        same_run = manifest is not None and candidate.parent.resolve() == manifest.path.parent.resolve()
        for trace, found_manifest in ((baseline, manifest),
                                      (candidate, manifest if same_run else headline.find_manifest(candidate))):
            dtypes, log = trace_query_dtypes(found_manifest, trace)
            found.append(dtypes.get("prefill"))
            if found_manifest is not None and found_manifest is not manifest:
                read.append(found_manifest.path)
            if log is not None:
                read.append(Path(log))
        return cls(manifest, (found[0], found[1]), tuple(read))

    @property
    def run_dir(self) -> Path | None:
        """The baseline's run directory: the head's commands are relative to it."""
        return self.manifest.path.parent if self.manifest is not None else None

    def attach(self, result: Diff, command: list[str] | None = None) -> Diff:
        """`result` with its headline: the environment and capture commands from the manifest, `command` (the
        command as run, for the head to show), and the query-quantization statement from the query dtypes."""
        result.headline = headline.Headline.of(result, self.manifest, command,
                                               statements.query_quantize_statements(result, self.query_dtypes))
        return result
