"""The demo on top of the learner library: the bundled example and the ways to run it.

`diloco-learner train` (`demo.cli`, `demo.train`) trains the bundled byte-level GPT
(`demo.example`) or a model of your own as one learner; `diloco-learner local` (`demo.local`)
runs a Synchronizer and N learners as processes on this host and draws the result
(`demo.plot`); `demo.procs` starts and ends those processes for the demo, the benchmarks and the
end-to-end tests. The `learner` library never imports this package.
"""
