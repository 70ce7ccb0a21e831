from loopkit.process.cli import main

raise SystemExit(main())
