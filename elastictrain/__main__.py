from elastictrain.cli import main

raise SystemExit(main())
