from specforge.cli import main

raise SystemExit(main())
