from loopkit.cli import main

raise SystemExit(main())
