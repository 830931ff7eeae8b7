from unbroken.cli import main

raise SystemExit(main())
